#!/bin/bash
set -u
export ROLLOUT_WORKER_CUBIN_CACHE=$PWD/.cubin
D=$OUT/r; mkdir -p $D
pack() { tar czf $OUT/r.tgz -C $OUT r; }
t0=$(date +%s); ts() { echo "$1 $(($(date +%s) - t0)) s" >> $D/times.txt; }
for f in .gpu/*.xz; do xz -d -f -T4 "$f"; done
chmod +x .gpu/rw_* .gpu/*.test
for v in w x; do
(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/$v.cubin .gpu/moe_$v.cu > $D/ptxas_$v.txt 2>&1; echo "rc $?" >> $D/ptxas_$v.txt;
 cuobjdump --dump-sass -fun gemm_fp4_ws /tmp/$v.cubin > $D/sass_$v.txt 2>&1) &
done
for v in m w x; do
(.gpu/rw_$v bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_$v.txt 2>&1) &
done
wait
ts warm; pack
for v in m w x; do
  timeout 90 .gpu/rw_$v bench moe --device cuda --tokens 4096 --csv $D/b_${v}_relu2.csv > $D/b_${v}_relu2.txt 2>&1
  ts "bench $v"; pack
done
timeout 90 .gpu/rw_x bench moe --device cuda --tokens 4096 --activation swiglu --csv $D/b_x_swiglu.csv > $D/b_x_swiglu.txt 2>&1
ts "bench x swiglu"; pack
(cd kernels/cuda && timeout 100 ../../.gpu/kcuda_x.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(128)_' > $D/sg_x.txt 2>&1; echo "rc $?" >> $D/sg_x.txt)
ts sg; pack
timeout 150 ncu --clock-control none -k regex:'^gemm_fp4_ws$' --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight -o /tmp/ws \
  .gpu/rw_x bench moe --device cuda --tokens 4096 --iters 1 --warmup 0 --graphs=false > $D/ncu_x.txt 2>&1
ncu -i /tmp/ws.ncu-rep --page source --csv --print-source sass > $D/ws_sass.csv 2>&1
ncu -i /tmp/ws.ncu-rep > $D/ncu_x_details.txt 2>&1
ts ncu; pack
