#!/bin/bash
# The fifteenth session's six device runs, as run: each was .gpu/runN.sh,
# the prelude below followed by the body of runN (run with
# `bash .gpu/runN.sh`, carry [".gpu"]). tools/gpurun/prelude.sh is the
# same prelude for later runs to source. Key: README.md.
# prelude of every run
set -u
export ROLLOUT_WORKER_CUBIN_CACHE=$PWD/.cubin
D=$OUT/r; mkdir -p $D
pack() { tar czf $OUT/r.tgz -C $OUT r; }
t0=$(date +%s); ts() { echo "$1 $(($(date +%s) - t0)) s" >> $D/times.txt; }
for f in .gpu/*.xz; do xz -d -f -T4 "$f"; done
chmod +x .gpu/rw_* .gpu/*.test

run1() {
	(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/w.cubin .gpu/moe_w.cu > $D/ptxas_w.txt 2>&1; echo "rc $?" >> $D/ptxas_w.txt) &
	(.gpu/rw_m bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_m.txt 2>&1) &
	cd kernels/cuda
	timeout 240 ../../.gpu/kcuda_w.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/inv.txt 2>&1; echo "rc $?" >> $D/inv.txt
	ts inv; pack
	timeout 150 ../../.gpu/kcuda_w.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(32|128)_' > $D/sg.txt 2>&1; echo "rc $?" >> $D/sg.txt
	ts sg; pack
	cd ../..
	wait
	ts wait
	for a in relu2 swiglu; do for v in m w; do
	  timeout 90 .gpu/rw_$v bench moe --device cuda --tokens 4096 --activation $a --csv $D/b_${v}_$a.csv > $D/b_${v}_$a.txt 2>&1
	  ts "bench $v $a"; pack
	done; done
	cd kernels/cuda
	timeout 120 ../../.gpu/kcuda_w.test -test.v -test.count=1 -test.run 'TestConformanceTiled/ws' > $D/conf.txt 2>&1; echo "rc $?" >> $D/conf.txt
	ts conf; pack
}

run2() {
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
}

run3() {
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
}

run4() {
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
}

run5() {
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
}

run6() {
	(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/z.cubin .gpu/moe_z.cu > $D/ptxas_z.txt 2>&1; echo "rc $?" >> $D/ptxas_z.txt) &
	(.gpu/rw_y bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_y.txt 2>&1) &
	cd kernels/cuda
	timeout 150 ../../.gpu/kcuda_z.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/inv.txt 2>&1; echo "rc $?" >> $D/inv.txt
	ts inv; pack
	timeout 60 ../../.gpu/kcuda_z.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(64|128)_' > $D/sg.txt 2>&1; echo "rc $?" >> $D/sg.txt
	ts sg; pack
	cd ../..
	wait
	for a in relu2 swiglu; do for v in y z; do
	  timeout 60 .gpu/rw_$v bench moe --device cuda --tokens 4096 --activation $a --csv $D/b_${v}_$a.csv > $D/b_${v}_$a.txt 2>&1
	  ts "bench $v $a"; pack
	done; done
	cd kernels/cuda
	timeout 60 ../../.gpu/kcuda_z.test -test.v -test.count=1 -test.run 'TestConformanceTiled/ws' > $D/conf.txt 2>&1; echo "rc $?" >> $D/conf.txt
	ts conf; pack
}
