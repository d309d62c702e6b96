#!/bin/sh
# check.sh parses and instantiates the CUDA kernels with the host C++
# compiler, for machines without nvcc or NVRTC: every compile unit with the
# headers NVRTC gets (errors.cuh generated from kernels/cuda's error table),
# and every kernel variant the backend's registry names instantiated. The
# stand-in cuda_bf16.h here turns the CUDA qualifiers into nothing and
# declares the intrinsics the kernels call. It catches C++ and template
# errors (a wrong argument count, an undeclared name, a registry entry with
# no such kernel), not what only NVRTC or ptxas can see: PTX in asm
# statements, NVRTC's own limits (no generic lambdas), registers.
# Usage, from the repository root: sh tools/cudasyntax/check.sh
set -eu
dir=$(dirname "$0")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go run ./tools/cudasyntax/dump "$tmp"
n=0
for f in "$tmp"/*.inst.cpp; do
	${CXX:-g++} -x c++ -std=c++17 -fsyntax-only -w -I"$dir" -I"$tmp/include" -I"$tmp" "$f"
	n=$((n + 1))
done
echo "cudasyntax: $n compile units parse, every registered kernel instantiated"
