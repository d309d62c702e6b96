#!/bin/bash
set -u
export ROLLOUT_WORKER_CUBIN_CACHE=$PWD/.cubin
D=$OUT/r; mkdir -p $D
pack() { tar czf $OUT/r.tgz -C $OUT r; }
t0=$(date +%s); ts() { echo "$1 $(($(date +%s) - t0)) s" >> $D/times.txt; }
for f in .gpu/*.xz; do xz -d -f -T4 "$f"; done
chmod +x .gpu/rw_* .gpu/*.test
(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/y.cubin .gpu/moe_y.cu > $D/ptxas_y.txt 2>&1; echo "rc $?" >> $D/ptxas_y.txt) &
(.gpu/rw_m bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_m.txt 2>&1) &
cd kernels/cuda
timeout 200 ../../.gpu/kcuda_y.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/inv.txt 2>&1; echo "rc $?" >> $D/inv.txt
ts inv; pack
timeout 100 ../../.gpu/kcuda_y.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(32|64|128)_' > $D/sg.txt 2>&1; echo "rc $?" >> $D/sg.txt
ts sg; pack
cd ../..
wait
for a in relu2 swiglu; do for v in m y; do
  timeout 90 .gpu/rw_$v bench moe --device cuda --tokens 4096 --activation $a --csv $D/b_${v}_$a.csv > $D/b_${v}_$a.txt 2>&1
  ts "bench $v $a"; pack
done; done
cd kernels/cuda
timeout 100 ../../.gpu/kcuda_y.test -test.v -test.count=1 -test.run 'TestConformanceTiled/ws' > $D/conf.txt 2>&1; echo "rc $?" >> $D/conf.txt
ts conf; pack
