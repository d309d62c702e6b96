#!/bin/bash
set -u
export ROLLOUT_WORKER_CUBIN_CACHE=$PWD/.cubin
D=$OUT/r; mkdir -p $D
pack() { tar czf $OUT/r.tgz -C $OUT r; }
t0=$(date +%s); ts() { echo "$1 $(($(date +%s) - t0)) s" >> $D/times.txt; }
for f in .gpu/*.xz; do xz -d -f -T4 "$f"; done
chmod +x .gpu/rw_* .gpu/*.test
(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/w.cubin .gpu/moe_w.cu > $D/ptxas_w.txt 2>&1; echo "rc $?" >> $D/ptxas_w.txt) &
(.gpu/rw_m bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_m.txt 2>&1) &
cd kernels/cuda
timeout 200 ../../.gpu/kcuda_w.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/inv.txt 2>&1; echo "rc $?" >> $D/inv.txt
ts inv; pack
timeout 100 ../../.gpu/kcuda_w.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(32|64|128)_' > $D/sg.txt 2>&1; echo "rc $?" >> $D/sg.txt
ts sg; pack
cd ../..
wait
ts wait
for a in relu2 swiglu; do for v in m w; do
  timeout 90 .gpu/rw_$v bench moe --device cuda --tokens 4096 --activation $a --csv $D/b_${v}_$a.csv > $D/b_${v}_$a.txt 2>&1
  ts "bench $v $a"; pack
done; done
for k in gemm_fp4_ws_ks2 gemm_fp4_ws; do
timeout 100 ncu --clock-control none -k regex:"^$k\$" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum \
  .gpu/rw_w bench moe --device cuda --tokens 4096 --iters 1 --warmup 0 --graphs=false > $D/ncu_$k.txt 2>&1
ts "ncu $k"; pack
done
