#!/bin/sh
# check.sh parses and instantiates the CUDA kernels with the host C++
# compiler, for machines without nvcc or NVRTC: the stand-in cuda_bf16.h
# here turns the CUDA qualifiers into nothing and declares the intrinsics
# the kernels call. It catches C++ and template errors (a wrong argument
# count, an undeclared name), not what only NVRTC or ptxas can see: PTX in
# asm statements, NVRTC's own limits (no generic lambdas), registers.
# Usage, from the repository root: sh tools/cudasyntax/check.sh
set -eu
dir=$(dirname "$0")
src=kernels/cuda/src
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$src/common.cuh" "$src/model.cu" "$src/moe.cu" > "$tmp/all.cu"
${CXX:-g++} -x c++ -std=c++17 -fsyntax-only -w -I"$dir" "$tmp/all.cu"
echo "cudasyntax: kernels parse"
