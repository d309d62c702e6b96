#!/bin/bash
set -u
export ROLLOUT_WORKER_CUBIN_CACHE=$PWD/.cubin
D=$OUT/r; mkdir -p $D
pack() { tar czf $OUT/r.tgz -C $OUT r; }
t0=$(date +%s); ts() { echo "$1 $(($(date +%s) - t0)) s" >> $D/times.txt; }
for f in .gpu/*.xz; do xz -d -f -T4 "$f"; done
chmod +x .gpu/rw_* .gpu/*.test
(nvcc -arch=sm_90a -std=c++17 -cubin -o /tmp/y.cubin .gpu/moe_y.cu > /dev/null 2>&1; cuobjdump --dump-sass -fun gemm_fp4_ws /tmp/y.cubin > $D/sass_ws.txt 2>&1) &
.gpu/rw_y bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_y.txt 2>&1
ts warm
for k in gemm_fp4_ws gemm_fp4_ws_ks2; do
timeout 80 ncu --clock-control none -k regex:"^$k\$" --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section SchedulerStats -o /tmp/$k \
  .gpu/rw_y bench moe --device cuda --tokens 4096 --iters 1 --warmup 0 --graphs=false > $D/ncu_$k.txt 2>&1
ncu -i /tmp/$k.ncu-rep --page source --csv --print-source sass > $D/${k}_sass.csv 2>&1
ncu -i /tmp/$k.ncu-rep > $D/${k}_details.txt 2>&1
ts "ncu $k"; pack
done
for a in relu2 swiglu; do
  timeout 120 .gpu/rw_y bench moe --device cuda --activation $a --csv $D/t_y_$a.csv > $D/t_y_$a.txt 2>&1
  ts "table $a"; pack
done
wait
(cd policy && timeout 90 ../.gpu/policy_y.test -test.v -test.count=1 -test.run 'TestGPU' > $D/policy.txt 2>&1; echo "rc $?" >> $D/policy.txt)
ts policy; pack
