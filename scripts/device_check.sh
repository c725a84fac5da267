#!/usr/bin/env bash
# Everything the GPU has to show, in one device call. Writes logs and JSON under $OUT.
# Pass the commit literally, FLASHATTN_GIT_SHA=<sha of this checkout> bash scripts/device_check.sh STAGE: the
# device's copy of .git lagged the working tree in the fourth session, so `git rev-parse HEAD` there named an
# older commit in every results JSON (benchmarks/results/h200-2026-11-29-s4/README.md).
#   bash scripts/device_check.sh tune     correctness check, sanitizers, config sweep
#   bash scripts/device_check.sh full     gpu tests, benchmark suites (train, memory, features)
#   bash scripts/device_check.sh verify|sparse|e2e_io      the inference, sparse, ecosystem and IO evidence
#   bash scripts/device_check.sh e2e_full                  what e2e_io left out
#   bash scripts/device_check.sh decode_tune               decode tiles x split counts, CUDA-graph timed
#   bash scripts/device_check.sh bwd_profile               ncu stall/pipe sections of the Gluon backward (d=64,
#                                                          d=128) and of the Triton backward at d=64, N=16K
#   bash scripts/device_check.sh host_profile              host time per call, layer by layer, and a cProfile
#                                                          (scripts/host_profile.py); the realistic core tests
#   bash scripts/device_check.sh fwd_profile               ncu pipes/stalls of the Gluon forward, the boundary tests
#   bash scripts/device_check.sh bwd_parts                 v34: the backward's kernels' GPU times apart
#   bash scripts/device_check.sh fwd_ship                  v32-v33 as shipped: the forward sweep at d=64 and
#                                                          128 (scripts/fwd_sweep.py), the forward GPU tests,
#                                                          racecheck, then the backward's kernels apart
#   bash scripts/device_check.sh fwd_checks                the forward GPU tests, racecheck reports in full, the
#                                                          d=128 forward sweep
#   bash scripts/device_check.sh host_s13                  v35 + v38's host time (host_profile.py beside cuDNN),
#                                                          the host-path tests, the core GPU tests
#   bash scripts/device_check.sh fwd_vs_cudnn              ncu of ours and cuDNN's forward at d=64 1K causal
#   bash scripts/device_check.sh table_v42                 the train table on v42, the d=64 backward GPU tests
#   bash scripts/device_check.sh fwd_source                ncu source counters (stalls per SASS instruction) of
#                                                          ours and cuDNN's forward at d=64 1K causal
#   bash scripts/device_check.sh table_checks              the train table, the torch.compile GPU tests,
#                                                          `flashattn check` (decode, block-sparse included)
#   bash scripts/device_check.sh bwd_causal                the d=128 causal backward against the full one: launch
#                                                          orders (scripts/bwd_sweep.py), ncu memory and stalls
#   bash scripts/device_check.sh bwd_stats                 v41 against the kernel before it (BWD_AB_OLD: a copy of
#                                                          its src), the backward GPU tests, memcheck, racecheck
#   bash scripts/device_check.sh bwd64_rows                v42: 128-row steps for the d=64 backward now that the
#                                                          row statistics left the registers
#   bash scripts/device_check.sh d256                      the train grid at d=256 (issue 3: reported, no target)
#   bash scripts/device_check.sh plan_checks               v25's launch plans under every feature: the feature
#                                                          check, `flashattn check`, the core GPU tests
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
stage=${1:-full}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# the block-sparse stage's 16K suite: TIMEOUT and the folder its files go to come first
sparse16k() {  # TIMEOUT DIR MODES PROVIDERS [bench options]: the 16K sparse suite, the summary's tail
  timeout "$1" python3 -m flashattn bench --suite sparse --seqlens 16384 --modes "$3" --quiet --providers "$4" \
    --out "$2/sparse16k" "${@:5}" 2>&1 | tail -30
}

# the README's train table (TIMEOUT, then the folder under $OUT): d=64 and 128, forward and backward, beside
# FA2, cuDNN and flex
train_table() {
  timeout "$1" python3 -m flashattn bench --suite train --headdims 64,128 --modes fwd,bwd --quiet \
    --providers flashattn,sdpa-flash,sdpa-cudnn,flex --out "$OUT/$2" 2>&1 | tail -60
}
ncu_bin() {  # Nsight Compute's CLI: on PATH, or where the CUDA toolkit and Nsight installs put it
  command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1
}
# the forward profile stages' two kernels: WHO (ours | cudnn) -> ncu's kernel filter, profile_case.py's last argument
fwd_kernel() { [ "$1" = cudnn ] && echo regex:sdpa || echo regex:attn_fwd_ws; }
fwd_case_arg() { [ "$1" = cudnn ] && echo cudnn; }
# the sections both profile stages read: time, pipes, warp stalls, issue slots
NCU_STALLS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats"

if [ "$stage" = tune ]; then
  python3 -c "import sys; from flashattn.demo import check; sys.exit(check())" 2>&1 | tee "$OUT/check.log"
  python3 scripts/gpu_features_check.py 2>&1 | tee "$OUT/features.log"
  timeout 240 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py 2>&1 | tail -5 | tee "$OUT/memcheck.log"
  timeout 400 python3 scripts/tune.py --out "$OUT/tune.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log"
fi

if [ "$stage" = full ]; then
  # everything under $OUT/res comes back as one archive (the device returns at most 8 files)
  mkdir -p "$OUT/res"
  timeout ${TEST_S:-200} python3 -m pytest -m gpu -q -rs --continue-on-collection-errors tests 2>&1 \
    | tee "$OUT/res/pytest_gpu.log" | tail -40
  timeout ${TRAIN_S:-300} python3 -m flashattn bench --suite train --quiet --no-plots ${TRAIN_ARGS:-} \
    --out "$OUT/res/train" 2>&1 | tail -30
  timeout ${MEM_S:-70} python3 -m flashattn bench --suite memory --quiet --no-plots --out "$OUT/res/memory" 2>&1 | tail -15
  timeout ${FEAT_S:-90} python3 -m flashattn bench --suite features --quiet --no-plots --out "$OUT/res/features" 2>&1 \
    | tail -15
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi

# the evidence issues 4, 5, 6 and 8 need, in three calls of under 10 minutes each:
#   verify    dense re-check, GPU tests of decode and block-sparse, memcheck of their kernels, decode suite
#   sparse    CUDA-graph decode under memcheck, block-sparse GPU tests, decode and sparse suites
#   e2e_io    ecosystem GPU tests (modules, transformers, e2e), e2e suite, Nsight Compute bytes vs the model
if [ "$stage" = verify ]; then
  mkdir -p "$OUT/res"
  timeout 60 python3 -c "import sys; from flashattn.demo import check; sys.exit(check())" 2>&1 \
    | tee "$OUT/res/check.log" | tail -3
  timeout 50 python3 scripts/gpu_features_check.py 2>&1 | tee "$OUT/res/features_check.log" | tail -3
  timeout 150 python3 -m pytest -m gpu -q -rs tests/test_decode_gpu.py tests/test_block_sparse_gpu.py 2>&1 \
    | tee "$OUT/res/pytest_decode_sparse.log" | tail -15
  timeout 60 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py decode sparse 2>&1 | tail -6 \
    | tee "$OUT/res/memcheck_decode_sparse.log"
  timeout 45 python3 -m flashattn.generate_demo 2>&1 | tee "$OUT/res/generate_demo.log" | tail -8
  timeout ${DECODE_S:-150} python3 -m flashattn bench --suite decode --quiet --out "$OUT/res/decode" 2>&1 | tail -40
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = sparse ]; then
  mkdir -p "$OUT/res"
  timeout 45 python3 -m flashattn.generate_demo 2>&1 | tee "$OUT/res/generate_demo.log" | tail -5
  timeout ${DECODE_S:-110} python3 -m flashattn bench --suite decode --quiet --out "$OUT/res/decode" 2>&1 | tail -30
  # fwd+bwd (the speed-up target) at 16K for every pattern and provider; at 64K ours only (flex compiles again)
  timeout ${SPARSE_S:-190} python3 -m flashattn bench --suite sparse --seqlens 16384 --modes fwd+bwd --quiet \
    --out "$OUT/res/sparse" 2>&1 | tail -30
  timeout 50 python3 -m flashattn bench --suite sparse --seqlens 65536 --modes fwd+bwd --quiet \
    --providers flashattn,flashattn-sparse --out "$OUT/res/sparse64k" 2>&1 | tail -12
  timeout 90 python3 -m pytest -m gpu -q -rs tests/test_modules.py tests/test_transformers.py tests/test_e2e_gpu.py \
    2>&1 | tee "$OUT/res/pytest_eco.log" | tail -6
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = e2e_io ]; then
  mkdir -p "$OUT/res"
  timeout ${E2E_S:-160} python3 -m flashattn bench --suite e2e --quick --out "$OUT/res/e2e" 2>&1 | tail -30
  # standard attention against ours at the paper's comparison point, then ours alone at N >= 2K and decode
  timeout 70 python3 scripts/ncu_io.py --shape b=4,h=16,n=4096,d=64 --out "$OUT/res/ncu_std" 2>&1 | tail -8
  timeout 110 python3 scripts/ncu_io.py --cases ours --shape b=2,h=16,n=2048,d=128 \
    --shape b=4,h=16,n=4096,d=128,causal=1 --shape b=1,h=16,n=16384,d=128,causal=1 \
    --decode-shape b=16,h=32,hk=8,sq=1,sk=16384,d=128 --decode-shape b=1,h=32,hk=8,sq=1,sk=65536,d=128 \
    --out "$OUT/res/ncu_ours" 2>&1 | tail -12
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = e2e_full ]; then
  mkdir -p "$OUT/res"
  timeout 560 python3 -m flashattn bench --suite e2e --out "$OUT/res/e2e" 2>&1 | tail -30
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = decode_tune ]; then
  mkdir -p "$OUT/res"
  timeout 300 python3 scripts/tune_decode.py --out "$OUT/res/tune_decode.json" 2>&1 | tail -20
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi

if [ "$stage" = bwd_profile ]; then
  # where the d=64 Gluon backward waits, beside d=128 (where it reaches the bar) and the Triton backward
  NCU=$(ncu_bin)
  # BWD_PROFILE_CASES narrows the list (each case: d N [triton])
  IFS=';' read -ra cases <<< "${BWD_PROFILE_CASES:-64 16384;128 16384;64 16384 triton}"
  for case in "${cases[@]}"; do
    set -- $case
    name="d$1_n$2${3:+_$3}"
    # the third backward's launches: one Gluon kernel per backward, or the Triton dK/dV and dQ programs
    if [ "${3:-}" = triton ]; then ws=0 kernel=regex:attn_bwd_kernel skip=4 count=2
    else ws=1 kernel=regex:attn_bwd_ws skip=2 count=1; fi
    FLASHATTN_WS_BWD=$ws timeout ${BWD_PROFILE_S:-150} "$NCU" --kernel-name "$kernel" --launch-skip $skip \
      --launch-count $count $NCU_STALLS --section Occupancy --section MemoryWorkloadAnalysis \
      python3 scripts/profile_case.py "$1" "$2" > "$OUT/ncu_$name.txt" 2>&1
    grep -E -i "Duration|Throughput|Stall|Issued|Eligible|Active Warps|Registers|Pipe" "$OUT/ncu_$name.txt" \
      | head -40
  done
fi

if [ "$stage" = fwd_profile ]; then
  # where the Gluon forward's time goes (NOTES v29/v30): pipes (tensor, SFU = xu, fma, alu), issue slots and
  # stalls; d=64 at 16K and 1K causal, and d=128 at 16K
  NCU=$(ncu_bin)
  # each case: d N FLASHATTN_WS (1: the Gluon forward) [causal]
  IFS=';' read -ra cases <<< "${FWD_PROFILE_CASES:-64 16384 1;64 1024 1 causal;128 16384 1}"
  for case in "${cases[@]}"; do
    set -- $case
    name="d$1_n$2_ws$3${4:+_$4}"
    kernel=$([ "$3" = 0 ] && echo regex:attn_fwd_kernel || echo regex:attn_fwd_ws)
    FLASHATTN_WS=$3 timeout 100 "$NCU" --kernel-name "$kernel" --launch-skip 2 --launch-count 1 $NCU_STALLS \
      --section InstructionStats \
      --metrics "regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*.avg.pct_of_peak_sustained_active" \
      python3 scripts/profile_case.py "$1" "$2" ${4:-} fwd > "$OUT/ncu_fwd_$name.txt" 2>&1
    echo "== $name"
    grep -E -i "Duration|SM Busy|Issue Slots|Issued Ipc|Stall|Eligible|pipe_(tensor|xu|fma|alu|fp16|uniform).*(pct|%)" \
      "$OUT/ncu_fwd_$name.txt" | grep -v -E " 0(\.0+)?$" | head -40
  done
  timeout 150 python3 -m pytest -m gpu -q -rs -x tests/test_ws_gpu.py -k tile_boundary 2>&1 \
    | tee "$OUT/pytest_boundary.log" | tail -4
fi

if [ "$stage" = host_profile ]; then
  timeout 200 python3 scripts/host_profile.py "$OUT/host_profile.json" 2>&1 | tee "$OUT/host_profile.log" | head -30
  timeout 330 python3 -m pytest -m gpu -q -rs tests/test_gpu_core.py -k realistic 2>&1 \
    | tee "$OUT/pytest_core_realistic.log" | tail -6
fi


if [ "$stage" = plan_checks ]; then
  timeout 90 python3 scripts/gpu_features_check.py 2>&1 | tee "$OUT/features.log" | tail -4
  timeout 70 python3 -m flashattn check 2>&1 | tee "$OUT/check.log" | tail -3
  timeout 180 python3 -m pytest -m gpu -q -rs tests/test_gpu_core.py -k "not realistic" 2>&1 \
    | tee "$OUT/pytest_core_rest.log" | tail -6
fi

if [ "$stage" = bwd_parts ]; then
  # NOTES v34: the backward's kernels apart (preprocess, Gluon kernel, the dQ conversion copy)
  timeout 240 python3 scripts/bwd_kernel_times.py "$OUT/bwd_kernel_times.json" 1024 2048 16384 2>&1 \
    | tee "$OUT/bwd_kernel_times.log"
fi
if [ "$stage" = fwd_ship ]; then
  # NOTES v32-v33 as shipped (three consumers at d = 64 past 1K; v31 then still a switch, off): the forward
  # variants at d = 64 and 128, the forward GPU tests, racecheck with two and three consumers, then (in what is
  # left of the call's 10 minutes) the backward's kernels apart (NOTES v34)
  timeout 260 python3 scripts/fwd_sweep.py "$OUT/fwd_sweep.json" 2>&1 | tee "$OUT/fwd_sweep.log"
  timeout 200 python3 -m pytest -m gpu -q -rs tests/test_ws_gpu.py -k "not backward" 2>&1 \
    | tee "$OUT/pytest_fwd.log" | tail -4
  timeout 45 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py ws_fwd 2>&1 | tail -3 \
    | tee "$OUT/racecheck.log"
  FLASHATTN_CONFIG=fwd_ws=192,128,4,3 timeout 45 compute-sanitizer --tool racecheck python3 \
    scripts/sanitize_case.py ws_fwd64 2>&1 | tail -3 | tee "$OUT/racecheck_three.log"
  timeout $((585 - SECONDS)) python3 scripts/bwd_kernel_times.py "$OUT/bwd_kernel_times.json" 1024 2048 16384 \
    2>&1 | tail -30
fi
if [ "$stage" = fwd_checks ]; then
  # fwd_ship's remainder: the forward GPU tests whole, racecheck's full reports (the s11 kernel, i.e. v32 off,
  # beside v32 with two and with three consumers: are its reports the v20/v23 kind or new?), the d=128 sweep
  for run in "s11 FLASHATTN_FWD_HALF_DIAG=0" "v32" "three FLASHATTN_CONFIG=fwd_ws=192,128,4,3"; do
    set -- $run
    env "${@:2}" timeout 50 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py ws_fwd64 \
      > "$OUT/racecheck_$1.log" 2>&1
    echo "racecheck $1: $(grep -c 'Race reported' "$OUT/racecheck_$1.log") reports; $(tail -2 "$OUT/racecheck_$1.log")"
  done
  timeout 300 python3 -m pytest -m gpu -q -x -rs tests/test_ws_gpu.py -k "not backward" 2>&1 \
    | tee "$OUT/pytest_fwd.log" | tail -4
  timeout $((585 - SECONDS)) python3 scripts/fwd_sweep.py "$OUT/fwd_sweep128.json" 128 2>&1 | tail -30
fi
if [ "$stage" = host_s13 ]; then
  # NOTES v35 + v38: host time per call (host_profile.py, cuDNN's public call beside ours: hosts differ between
  # sessions), the host-path tests on the GPU, then the GPU tests that repeat calls across shapes, dtypes and
  # features through the launchers' caches (the core tests, torch.compile's among them); one archive back
  res=/tmp/host_s13; mkdir -p "$res"
  timeout 150 python3 scripts/host_profile.py "$res/host_profile.json" 2>&1 | tee "$res/host_profile.log" | head -32
  timeout 60 python3 -m pytest -q -rs tests/test_host_paths.py tests/test_launch.py 2>&1 \
    | tee "$res/pytest_host_paths.log" | tail -2
  tar -C /tmp -czf "$OUT/host_s13.tgz" host_s13
  timeout $((585 - SECONDS)) python3 -m pytest -m gpu -q -rs tests/test_gpu_core.py -k "not realistic" 2>&1 \
    | tee "$res/pytest_core.log" | tail -4
  tar -C /tmp -czf "$OUT/host_s13.tgz" host_s13
fi
if [ "$stage" = fwd_vs_cudnn ]; then
  # ours and cuDNN's forward at d=64 1K causal (the M1 miss) side by side: pipes, issue slots, stalls, occupancy;
  # NCU_EXTRA_METRICS=",regex:..." adds metrics (e.g. the stall reasons per issued instruction)
  NCU=$(ncu_bin)
  for who in ours cudnn; do
    timeout 140 "$NCU" --kernel-name "$(fwd_kernel "$who")" --launch-skip 2 --launch-count 1 $NCU_STALLS \
      --section Occupancy --section LaunchStats --section InstructionStats \
      --metrics "regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active${NCU_EXTRA_METRICS:-}" \
      python3 scripts/profile_case.py 64 1024 causal fwd $(fwd_case_arg "$who") \
      > "$OUT/ncu_fwd_$who.txt" 2>&1
    echo "== $who"
    grep -E -i "Kernel Name|  [a-z_]*sdpa|attn_fwd_ws|Duration|Issue Slots|Issued Ipc|Stall|Eligible|Registers|Block Size|Grid Size|Achieved Occ|Shared Memory Config|pipe_(tensor|xu|fma|alu).*(pct|%)" \
      "$OUT/ncu_fwd_$who.txt" | grep -v -E " 0(\.0+)?$" | head -40
  done
fi
if [ "$stage" = fwd_source ]; then
  # NOTES "The thirteenth session": where our d=64 1K causal forward's warps stall, per SASS instruction
  # (barrier, wait, no instruction), beside cuDNN's; the raw report (open with ncu-ui) comes back too
  NCU=$(ncu_bin)
  for who in ours cudnn; do
    timeout 200 "$NCU" --kernel-name "$(fwd_kernel "$who")" --launch-skip 2 --launch-count 1 --section SourceCounters \
      --section WarpStateStats --import-source yes -o "$OUT/src_$who" \
      python3 scripts/profile_case.py 64 1024 causal fwd $(fwd_case_arg "$who") > /dev/null 2>&1
    "$NCU" -i "$OUT/src_$who.ncu-rep" --page details --print-details all > "$OUT/src_$who.txt" 2>&1
    "$NCU" -i "$OUT/src_$who.ncu-rep" --page source --csv --print-source sass > "$OUT/src_${who}_sass.csv" 2>&1
    echo "== $who: $(wc -l < "$OUT/src_${who}_sass.csv") SASS lines"; grep -i -A12 "Warp Stall Sampling" \
      "$OUT/src_$who.txt" | head -30
  done
fi
if [ "$stage" = bwd_causal ]; then
  # NOTES v41: per step, the d=128 causal backward is ~16% slower than the full one at 16K. Launch orders (L2
  # reuse of Q, dO and the dQ buffer), then ncu of both at 16K: L2 hit rate, DRAM bytes, local memory (the
  # spill), stalls; the causal one's stalls per SASS instruction
  BWD_SWEEP_GROUPS=${BWD_SWEEP_GROUPS:-1,4,all} BWD_SWEEP_REPEAT=${BWD_SWEEP_REPEAT:-2} timeout 200 \
    python3 scripts/bwd_sweep.py "$OUT/bwd_sweep.json" 2>&1 | tee "$OUT/bwd_sweep.log"
  NCU=$(ncu_bin)
  mem="lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_red.sum"
  mem="$mem,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum"
  for mask in causal full; do
    timeout 120 "$NCU" --kernel-name regex:attn_bwd_ws --launch-skip 2 --launch-count 1 $NCU_STALLS \
      --section MemoryWorkloadAnalysis --metrics "$mem" \
      python3 scripts/profile_case.py 128 16384 $mask > "$OUT/ncu_bwd_$mask.txt" 2>&1
    echo "== $mask"
    grep -E -i "Duration|Issued Ipc|Stall|Memory Throughput|DRAM Through|L2 Hit|lts__|dram__|l1tex__" \
      "$OUT/ncu_bwd_$mask.txt" | grep -v -E " 0(\.0+)?$" | head -40
  done
  timeout 150 "$NCU" --kernel-name regex:attn_bwd_ws --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --import-source yes -o "$OUT/src_bwd" python3 scripts/profile_case.py 128 16384 \
    causal > /dev/null 2>&1
  "$NCU" -i "$OUT/src_bwd.ncu-rep" --page source --csv --print-source sass > "$OUT/src_bwd_sass.csv" 2>&1
  echo "source counters: $(wc -l < "$OUT/src_bwd_sass.csv") SASS lines"
fi
if [ "$stage" = bwd_stats ]; then
  # NOTES v41: the backward with LSE and D read from shared memory against the kernel before it, interleaved
  # rounds in separate processes (the launcher's arguments differ, so not one process), then its GPU tests and
  # the sanitizers (the loader's TMA copies changed)
  mkdir -p "$OUT/ab"
  for round in 1 2; do
    for tree in ${BWD_AB_OLD:-} src; do
      echo "== round $round: $tree"
      PYTHONPATH=$PWD/$tree BWD_SWEEP_SHAPES=${BWD_SWEEP_SHAPES:-"1,16384,1;1,16384,0;4,4096,1;16,1024,1"} \
        timeout 150 python3 scripts/bwd_sweep.py "$OUT/ab/${tree//\//_}_$round.json" 128 64 2>&1 | tail -30
    done
  done
  tar -C "$OUT" -czf "$OUT/ab.tgz" ab && rm -r "$OUT/ab"
  timeout 200 python3 -m pytest -m gpu -q -rs tests/test_ws_gpu.py -k backward 2>&1 \
    | tee "$OUT/pytest_ws_bwd.log" | tail -4
  timeout 60 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py ws_bwd 2>&1 | tail -3 \
    | tee "$OUT/memcheck.log"
  timeout 60 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py ws_bwd 2>&1 | tail -3 \
    | tee "$OUT/racecheck.log"
fi
if [ "$stage" = d256 ]; then
  # issue 3 asks that d=256 works and is reported (no target): the train grid at d=256 beside FA2 and cuDNN
  timeout 230 python3 -m flashattn bench --suite train --headdims 256 --modes fwd,bwd --quiet \
    --providers flashattn,sdpa-flash,sdpa-cudnn --out "$OUT/train256" 2>&1 | tail -40
fi
if [ "$stage" = table_v42 ]; then
  # the README's table on v42 (128-row steps for the d=64 backward without the mask), then the d=64 backward's
  # GPU tests under the shipped rule
  train_table 330 train
  timeout $((560 - SECONDS)) python3 -m pytest -m gpu -q -rs tests/test_ws_gpu.py -k "backward and 64" 2>&1 \
    | tee "$OUT/pytest_bwd64.log" | tail -4
fi
if [ "$stage" = bwd64_rows ]; then
  # NOTES v42: the d=64 backward with 128-row steps (v21 lost 32-45% to 920 B of spill; v41 leaves 104 B) and
  # with dQ in step order, beside the shipped 64-row deferred-dQ steps; then the backward GPU tests under the
  # winner's config (BWD64_TEST_CONFIG, when given)
  one='{"128 rows, 2 stages": {"FLASHATTN_CONFIG": "bwd_ws=128,128,4,2", "FLASHATTN_BWD_DEFER_DQ": "0"},'
  two=' "128 rows, 3 stages": {"FLASHATTN_CONFIG": "bwd_ws=128,128,4,3", "FLASHATTN_BWD_DEFER_DQ": "0"},'
  three=' "64 rows, step dQ": {"FLASHATTN_BWD_DEFER_DQ": "0"}}'
  BWD_SWEEP_EXTRA="$one$two$three" BWD_SWEEP_REPEAT=2 \
    BWD_SWEEP_SHAPES=${BWD_SWEEP_SHAPES:-"16,1024,0;4,4096,0;1,16384,0;16,1024,1;1,16384,1"} timeout 300 \
    python3 scripts/bwd_sweep.py "$OUT/bwd64_rows.json" 64 2>&1 | tee "$OUT/bwd64_rows.log"
  if [ -n "${BWD64_TEST_CONFIG:-}" ]; then
    FLASHATTN_CONFIG=$BWD64_TEST_CONFIG FLASHATTN_BWD_DEFER_DQ=0 timeout $((585 - SECONDS)) python3 -m pytest \
      -m gpu -q -rs tests/test_ws_gpu.py -k "backward and 64 and not dq_orders" 2>&1 | tee "$OUT/pytest_bwd64.log" \
      | tail -4
  fi
fi
if [ "$stage" = table_checks ]; then
  # the README's table on the shipped code, then what v25's launch plans had not yet been checked under:
  # torch.compile (the core GPU tests' compile cases) and `flashattn check`'s decode and block-sparse cases
  train_table 330 train
  timeout 100 python3 -m pytest -m gpu -q -rs tests/test_gpu_core.py -k compile 2>&1 \
    | tee "$OUT/pytest_compile.log" | tail -4
  timeout 130 python3 -m flashattn check 2>&1 | tee "$OUT/check.log" | tail -8
fi
