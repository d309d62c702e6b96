#!/bin/bash
# ab.sh runs on the GPU machine (through the device tool, carry [".gpu"]):
# it unpacks .gpu/*.xz, compiles every variant's kernels once (NVRTC, in
# parallel, into the cubin cache), then times `bench moe` of the variants
# side by side, ROUNDS rounds, the order reversed every other round (so
# neither variant always runs first). Each round's CSV is
# $OUT/r/ab_V_R.csv and the whole of $OUT/r is packed into $OUT/r.tgz
# after every round: the device tool returns at most eight files, and
# what a run that is cut short had written comes back.
# Usage: bash tools/gpurun/ab.sh "V1 V2 ..." ROUNDS [bench moe flags]
# e.g.   bash tools/gpurun/ab.sh "m x" 2 --tokens 1,8
set -u
vs=($1) rounds=$2
shift 2
cd "$(dirname "$0")/../.."
export ROLLOUT_WORKER_CUBIN_CACHE=${ROLLOUT_WORKER_CUBIN_CACHE:-$PWD/.cubin}
G=.gpu D=${OUT:?no OUT}/r
mkdir -p "$D"
pack() { tar czf "$OUT/r.tgz" -C "$OUT" r; }
for f in $G/*.xz; do
	[ -e "$f" ] || continue
	xz -d -f -T4 "$f" 2>/dev/null ||
		python3 -c "import lzma,sys;open(sys.argv[1][:-3],'wb').write(lzma.open(sys.argv[1]).read())" "$f"
done
chmod +x $G/rw_* $G/*.test 2>/dev/null
t0=$(date +%s)
for v in "${vs[@]}"; do
	$G/rw_$v bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 \
		> "$D/warm_$v.txt" 2>&1 &
done
wait
echo "warm $(($(date +%s) - t0)) s" >> "$D/times.txt"
for ((r = 1; r <= rounds; r++)); do
	order=("${vs[@]}")
	if ((r % 2 == 0)); then
		order=()
		for ((i = ${#vs[@]} - 1; i >= 0; i--)); do order+=("${vs[i]}"); done
	fi
	for v in "${order[@]}"; do
		$G/rw_$v bench moe --device cuda --csv "$D/ab_${v}_$r.csv" "$@" > "$D/ab_${v}_$r.txt" 2>&1
	done
	echo "round $r $(($(date +%s) - t0)) s" >> "$D/times.txt"
	pack
done
# The NVFP4 and BF16 means over the rounds, per variant and batch size.
for v in "${vs[@]}"; do
	cat "$D"/ab_${v}_*.csv 2>/dev/null | awk -F, -v v="$v" '$1 ~ /^[0-9]+$/ {n[$1]++; a[$1] += $7; b[$1] += $8}
		END {for (t in n) printf "%s tokens %s: nvfp4 %.1f us, bf16 %.1f us (%d rounds)\n", v, t, a[t]/n[t], b[t]/n[t], n[t]}'
done | sort -k3n | tee "$D/summary.txt"
pack
