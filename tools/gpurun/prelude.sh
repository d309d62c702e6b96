#!/bin/bash
# prelude.sh is sourced by a device run's script (.gpu/runN.sh, run from
# the repository root through the device tool with carry [".gpu"]):
#   source tools/gpurun/prelude.sh
# It sets the cubin cache, makes $D ($OUT/r) for the outputs, unpacks
# .gpu/*.xz (tools/gpurun/build.sh) and defines
#   pack     tar $OUT/r into $OUT/r.tgz (the device tool returns at most
#            eight files, so call it after every step worth keeping)
#   ts NAME  append "NAME <seconds since the start> s" to $D/times.txt
set -u
export ROLLOUT_WORKER_CUBIN_CACHE=${ROLLOUT_WORKER_CUBIN_CACHE:-$PWD/.cubin}
D=${OUT:?no OUT}/r
mkdir -p "$D"
pack() { tar czf "$OUT/r.tgz" -C "$OUT" r; }
t0=$(date +%s)
ts() { echo "$1 $(($(date +%s) - t0)) s" >> "$D/times.txt"; }
for f in .gpu/*.xz; do
	[ -e "$f" ] || continue
	xz -d -f -T4 "$f"
done
chmod +x .gpu/rw_* .gpu/*.test 2>/dev/null
