#!/bin/bash
# The sixteenth session's five device runs, as run (the repeated warm-up,
# 4096-token A/B, ptxas and sanitizer steps folded into warm, ab4096,
# ptxas_of and sanitize): each was .gpu/runN.sh
# (`bash .gpu/runN.sh`, carry [".gpu"]), whose first line sourced
# tools/gpurun/prelude.sh; binaries built with
# `sh tools/gpurun/build.sh [-t] V REV`. Key: README.md.
# From run3 on, .gpu/cubin.tgz was run2's $OUT/cubin.tgz: the NVRTC cubin
# cache of main's kernel sources, carried so that main's binaries skip the
# ~100 s compile (`tar xzf .gpu/cubin.tgz` restores .cubin/).
source tools/gpurun/prelude.sh

# warm V: one tiny layer, so NVRTC compiles V's kernels into the cubin cache
# before anything is timed.
warm() {
	.gpu/rw_$1 bench moe --device cuda --tokens 1 --hidden 512 --intermediate 256 --experts 16 --iters 1 --warmup 0 > $D/warm_$1.txt 2>&1
}

# ab4096 PREFIX "V1 V2": the layer at 4096 tokens, SwiGLU then squared
# ReLU, each variant in the order given, into $D/PREFIX_V_A.{csv,txt}.
ab4096() {
	for a in swiglu relu2; do for v in $2; do
	  timeout 60 .gpu/rw_$v bench moe --device cuda --tokens 4096 --activation $a --csv $D/$1_${v}_$a.csv > $D/$1_${v}_$a.txt 2>&1
	  ts "bench $1 $v $a"; pack
	done; done
}

run1() {
	(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/b.cubin .gpu/moe_b.cu > $D/ptxas_b.txt 2>&1; echo "rc $?" >> $D/ptxas_b.txt) &
	for v in m b; do
	warm $v &
	done
	wait
	ts warm; pack
	ab4096 b "m b"
	cd kernels/cuda
	timeout 100 ../../.gpu/kcuda_b.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(64|128)_' > $D/sg_b.txt 2>&1; echo "rc $?" >> $D/sg_b.txt
	ts sg; pack
	timeout 100 ../../.gpu/kcuda_b.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance|TestConformanceTiled/ws' > $D/inv_b.txt 2>&1; echo "rc $?" >> $D/inv_b.txt
	ts inv_b; pack
	timeout 120 compute-sanitizer --tool memcheck ../../.gpu/kcuda_m.test -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/memcheck_m.txt 2>&1; echo "rc $?" >> $D/memcheck_m.txt
	ts memcheck; pack
	timeout 120 compute-sanitizer --tool racecheck ../../.gpu/kcuda_m.test -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/racecheck_m.txt 2>&1; echo "rc $?" >> $D/racecheck_m.txt
	ts racecheck; pack
}

run2() {
	(nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/b.cubin .gpu/moe_b.cu > /dev/null 2>&1; cuobjdump --dump-sass -fun gemm_fp4_ws192_swiglu_ks2 /tmp/b.cubin > $D/sass_ws192_swiglu_ks2.txt 2>&1) &
	warm b
	ts warm; tar czf $OUT/cubin.tgz .cubin; pack
	for a in relu2 swiglu; do for v in n b; do
	  timeout 80 .gpu/rw_$v bench moe --device cuda --tokens 3328,3584 --activation $a --csv $D/t_${v}_$a.csv > $D/t_${v}_$a.txt 2>&1
	  ts "bench $v $a"; pack
	done; done
	for k in gemm_fp4_ws192_swiglu_ks2:swiglu gemm_fp4_ws192:relu2; do
	  n=${k%%:*}; a=${k##*:}
	  timeout 120 ncu --clock-control none -k regex:"^$n\$" --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section SchedulerStats --section Occupancy \
	    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active -o /tmp/$n \
	    .gpu/rw_b bench moe --device cuda --tokens 4096 --activation $a --iters 1 --warmup 0 --graphs=false > $D/ncu_$n.txt 2>&1
	  ncu -i /tmp/$n.ncu-rep --page source --csv --print-source sass > $D/sass_$n.csv 2>&1
	  ncu -i /tmp/$n.ncu-rep > $D/ncu_${n}_details.txt 2>&1
	  python3 tools/ncusass/ncusass.py $D/sass_$n.csv --groups 10 > $D/ncusass_$n.txt 2>&1
	  gzip $D/sass_$n.csv
	  ts "ncu $n"; pack
	done
	wait
	cd kernels/cuda
	timeout 60 compute-sanitizer --tool memcheck ../../.gpu/kcuda_b.test -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/memcheck_b.txt 2>&1; echo "rc $?" >> $D/memcheck_b.txt
	ts memcheck; pack
	timeout 150 compute-sanitizer --tool racecheck ../../.gpu/kcuda_b.test -test.count=1 -test.run 'TestConformanceTiled/(ws|ws192)/GroupedGemm(Rows)?$' > $D/racecheck_b.txt 2>&1; echo "rc $?" >> $D/racecheck_b.txt
	ts racecheck; pack
	timeout 90 compute-sanitizer --tool synccheck ../../.gpu/kcuda_b.test -test.count=1 -test.run 'TestConformanceTiled/(ws|ws192)/GroupedGemm(Rows)?$' > $D/synccheck_b.txt 2>&1; echo "rc $?" >> $D/synccheck_b.txt
	ts synccheck; pack
}

# ptxas_V: the register, spill and serialization lines of the gemm_fp4_ws* kernels.
ptxas_of() {
	nvcc -arch=sm_90a -std=c++17 -cubin -Xptxas -v -o /tmp/$1.cubin .gpu/moe_$1.cu > $D/ptxas_$1_full.txt 2>&1; echo "rc $?" >> $D/ptxas_$1_full.txt
	grep -A3 "gemm_fp4_ws" $D/ptxas_$1_full.txt | grep -E "entry|Used|spill" > $D/ptxas_$1.txt
	grep -c "serializ" $D/ptxas_$1_full.txt >> $D/ptxas_$1.txt; tail -1 $D/ptxas_$1_full.txt >> $D/ptxas_$1.txt; rm $D/ptxas_$1_full.txt
}

run3() {
	tar xzf .gpu/cubin.tgz
	ptxas_of g &
	warm g &
	for a in relu2 swiglu; do
	  timeout 170 .gpu/rw_m bench moe --device cuda --activation $a --compare-finalize --csv $D/table_m_$a.csv --plot $D/moe_$a.svg > $D/table_m_$a.txt 2>&1
	  ts "table m $a"; pack
	done
	wait
	ts warm_g; pack
	ab4096 b "g m"
	cd kernels/cuda
	timeout 60 ../../.gpu/kcuda_g.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance|TestConformanceTiled/ws' > $D/inv_g.txt 2>&1; echo "rc $?" >> $D/inv_g.txt
	ts inv_g; pack
	# (then TestStreamedGemm rows 128 and the three sanitizers on kcuda_g, as in run4: all failed at
	# NVRTC's compile of g, run3_nvrtc_error_g.txt)
	cd ../..
	for a in relu2 swiglu; do
	  timeout 100 python3 tools/torch_moe_bench.py --activation $a --csv $D/torch_$a.csv > $D/torch_$a.txt 2>&1
	  ts "torch $a"; pack
	done
}

run4() {
	tar xzf .gpu/cubin.tgz
	ptxas_of g &
	warm g &
	cd kernels/cuda
	timeout 200 ../../.gpu/kcuda_m.test -test.v -test.count=1 -test.skip 'TestStreamedGemm$' > $D/kcuda_m.txt 2>&1; echo "rc $?" >> $D/kcuda_m.txt
	ts kcuda_m; pack
	cd ../../policy
	timeout 120 ../.gpu/policy_m.test -test.v -test.count=1 -test.run 'TestGPU' > $D/policy_m.txt 2>&1; echo "rc $?" >> $D/policy_m.txt
	ts policy_m; pack
	cd ..
	timeout 60 .gpu/rw_m bench refit --device cuda > $D/refit_m.txt 2>&1; echo "rc $?" >> $D/refit_m.txt
	ts refit; pack
	wait
	ts warm_g; pack
	ab4096 b "g m"
	cd kernels/cuda
	timeout 40 ../../.gpu/kcuda_g.test -test.v -test.count=1 -test.run 'TestGroupedGemmInvariance|TestConformanceTiled' > $D/inv_g.txt 2>&1; echo "rc $?" >> $D/inv_g.txt
	ts inv_g; pack
	sanitize g
	timeout 60 ../../.gpu/kcuda_g.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(64|128)_' > $D/sg_g.txt 2>&1; echo "rc $?" >> $D/sg_g.txt
	ts sg_g; pack
	timeout 150 ../../.gpu/kcuda_g.test -test.v -test.count=1 -test.skip 'TestStreamedGemm$' > $D/kcuda_g.txt 2>&1; echo "rc $?" >> $D/kcuda_g.txt
	ts kcuda_g; pack
	cd ../../policy
	timeout 100 ../.gpu/policy_g.test -test.v -test.count=1 -test.run 'TestGPU' > $D/policy_g.txt 2>&1; echo "rc $?" >> $D/policy_g.txt
	ts policy_g; pack
}

# sanitize V (from kernels/cuda): memcheck on the invariance test, racecheck
# and synccheck on the conformance suite's grouped GEMMs with every NVFP4
# grouped GEMM on the warp-specialised tiles.
sanitize() {
	timeout 30 compute-sanitizer --tool memcheck ../../.gpu/kcuda_$1.test -test.count=1 -test.run 'TestGroupedGemmInvariance' > $D/memcheck_$1.txt 2>&1; echo "rc $?" >> $D/memcheck_$1.txt
	timeout 30 compute-sanitizer --tool racecheck ../../.gpu/kcuda_$1.test -test.v -test.count=1 -test.run 'TestConformanceTiled/(ws|ws192)/GroupedGemm(Rows)?$' > $D/racecheck_$1.txt 2>&1; echo "rc $?" >> $D/racecheck_$1.txt
	timeout 30 compute-sanitizer --tool synccheck ../../.gpu/kcuda_$1.test -test.count=1 -test.run 'TestConformanceTiled/(ws|ws192)/GroupedGemm(Rows)?$' > $D/synccheck_$1.txt 2>&1; echo "rc $?" >> $D/synccheck_$1.txt
	ts sanitizers_$1; pack
}

run5() {
	tar xzf .gpu/cubin.tgz
	ptxas_of h &
	warm h &
	for a in relu2 swiglu; do
	  timeout 60 python3 tools/torch_moe_bench.py --tokens 4096 --activation $a --csv $D/torch_$a.csv > $D/torch_$a.txt 2>&1
	  ts "torch $a"; pack
	done
	wait
	ts warm_h; pack
	for round in 1 2; do
	  if [ $round = 1 ]; then order="h m"; else order="m h"; fi
	  ab4096 b$round "$order"
	done
	cd kernels/cuda
	timeout 90 ../../.gpu/kcuda_h.test -test.v -test.count=1 -test.skip 'TestStreamedGemm$' > $D/kcuda_h.txt 2>&1; echo "rc $?" >> $D/kcuda_h.txt
	ts kcuda_h; pack
	sanitize h
	timeout 40 ../../.gpu/kcuda_h.test -test.v -test.count=1 -test.run 'TestStreamedGemm$/nvfp4_.*_rows(64|128)_' > $D/sg_h.txt 2>&1; echo "rc $?" >> $D/sg_h.txt
	ts sg_h; pack
	cd ../../policy
	timeout 40 ../.gpu/policy_h.test -test.v -test.count=1 -test.run 'TestGPU' > $D/policy_h.txt 2>&1; echo "rc $?" >> $D/policy_h.txt
	ts policy_h; pack
	cd ..
	n=gemm_fp4_ws192_swiglu_ks2
	timeout 60 ncu --clock-control none -k regex:"^$n\$" --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section SchedulerStats -o /tmp/$n \
	  .gpu/rw_h bench moe --device cuda --tokens 4096 --activation swiglu --iters 1 --warmup 0 --graphs=false > $D/ncu_h_$n.txt 2>&1
	ncu -i /tmp/$n.ncu-rep --page source --csv --print-source sass > $D/sass_h_$n.csv 2>&1
	ncu -i /tmp/$n.ncu-rep > $D/ncu_h_${n}_details.txt 2>&1
	python3 tools/ncusass/ncusass.py $D/sass_h_$n.csv --groups 10 > $D/ncusass_h_$n.txt 2>&1
	gzip $D/sass_h_$n.csv
	ts ncu; pack
}
