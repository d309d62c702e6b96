#!/bin/sh
# build.sh builds one variant for the GPU machine from a git revision:
# .gpu/rw_V (the CLI), .gpu/moe_V.cu (src/common.cuh + src/moe.cu, for
# ptxas and cuobjdump there) and, with -t, .gpu/kcuda_V.test and
# .gpu/policy_V.test; binaries are xz-compressed (the device tool carries
# at most 64 MiB). Run from the repository root; .gpu/ must be git-ignored
# (.git/info/exclude). Usage: sh tools/gpurun/build.sh [-t] V REV
set -eu
tests=
if [ "${1:-}" = -t ]; then tests=1; shift; fi
v=$1 rev=$2
root=$(pwd)
mkdir -p "$root/.gpu"
wt=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$wt" "$rev"
cd "$wt"
export CGO_ENABLED=0
go build -trimpath -ldflags="-s -w" -o "$root/.gpu/rw_$v" ./cmd/rollout-worker
cat kernels/cuda/src/common.cuh kernels/cuda/src/moe.cu > "$root/.gpu/moe_$v.cu"
out="$root/.gpu/rw_$v"
if [ -n "$tests" ]; then
	go test -c -trimpath -ldflags="-s -w" -o "$root/.gpu/kcuda_$v.test" ./kernels/cuda
	go test -c -trimpath -ldflags="-s -w" -o "$root/.gpu/policy_$v.test" ./policy
	out="$out $root/.gpu/kcuda_$v.test $root/.gpu/policy_$v.test"
fi
xz -f -T2 -6 $out
echo "gpurun: built $v from $(git rev-parse --short HEAD)"
