#!/usr/bin/env bash
# The GPU runner: what the device has to show, in named stages, in one call. Everything lands under
# $OUT/res and comes back as one archive, $OUT/res.tgz (the device returns at most 8 files), which this script
# writes itself, removing $OUT/res: a tar of $OUT/res after it finds no folder and leaves an empty archive
# in the one's place.
#
#   FLASHATTN_GIT_SHA=<sha> bash scripts/device_run.sh STAGE [STAGE ...]
#
# The sha written literally into the command (`git rev-parse --short HEAD` here, before the call): the
# device's copy of the tree carries git metadata that can lag the working tree, so a $(git rev-parse) run
# there labels the results with an older commit.
#
# Stages, each named for what it measures:
#   fa4-libs      store FlashAttention-4's libraries for the next call (call carrying .fa4a; see
#                 ../shared/tools/fa4-wheels.sh), which carries .fa4b and unpacks them
#   gpu-tests     pytest -m gpu: every GPU test (or GPU_TESTS="paths", GPU_TESTS_K="a -k expression"), its
#                 summary; GPU_TESTS_SHARD=I/N the I-th of N interleaved shares (one call each); GPU_TESTS_N
#                 xdist workers (default 8: the compiles are the cost, and they run on the host's cores;
#                 decode's GPU files need <= 8: each worker holds its caches on the one GPU)
#   sanitize      compute-sanitizer memcheck and racecheck on small odd shapes of every kernel
#                 (SANITIZE_MEMCHECK / SANITIZE_RACECHECK / SANITIZE_SYNCCHECK: the cases, unset all (synccheck:
#                 the backward's), empty none; SANITIZE_S: seconds a case)
#   fuzz-memcheck the fuzz's GPU sample under compute-sanitizer memcheck (tests/test_fuzz.py's GPU test: 150
#                 calls in 4 shards side by side; each log ends with the call that faulted, if one did)
#   train-table   the train suite (d 64/128, N 1K-16K, causal or not, fwd and bwd) beside cuDNN (and FA4)
#                 (TRAIN_SEQLENS: a subset of N, e.g. 1024,16384; TRAIN_MODES: fwd or bwd alone;
#                 TRAIN_PROVIDERS: another list, flashattn-baseline among them with .baseline carried)
#   ab-workloads  the workloads suite beside another revision of this tree in the same process (provider
#                 flashattn-baseline: `bash scripts/vendor_tree.sh REV flashattn_base`, carry .baseline), cuDNN
#                 and FA4 (AB_MODES: fwd or bwd alone)
#   padded-heads  head dims below the Gluon kernels' tile widths (d 40, 80, 96, dv < d): their forced-route
#                 GPU tests, memcheck on ws_padded, and the train suite at d 80 and 96 on the default routes
#                 (Triton) beside the forced Gluon ones (flashattn-gluon) and cuDNN (PADDED_S: the bench's limit)
#   short         the short suite (1-64 query rows against 4K / 32K keys) on the default routes beside the
#                 split-KV forward (flashattn-short-split), the Gluon forward's GQA groups unpacked
#                 (flashattn-unpacked), cuDNN (and FA4)
#   generate      Hugging Face generate end to end (the transformers on the device), ours against SDPA:
#                 batch 1 and 16, prompts 1K and 8K, eager and static cache with CUDA graphs
#   paged         paged varlen prefill (pages of 256, no gradient) read in the kernel beside the same pages
#                 gathered first and the packed call: the workloads suite's packed documents and the features
#                 suite's (forward, causal)
#   long-backward the memory suite at 32K-128K (b1 h16 d128 causal, forward + backward: peak memory beyond the
#                 inputs and TFLOP/s) beside the Triton backward and cuDNN: past the dQ buffer's cap the
#                 backward runs by groups of KV heads (backends/triton/head_groups.py); LONG_SEQLENS: a subset
#   deterministic the fixed-order backward beside the default order: its GPU tests (deterministic in the
#                 name), then the train suite at 4K / 16K (d 64 / 128) and the workloads suite's causal
#                 backward rows with flashattn-deterministic; DET_S: each bench's limit
#   features      the features suite (packed documents against equal batches, windows against full)
#   workloads     the workloads suite (packed documents, windows, softcap, sinks, GQA/MQA, d=256, dv < d) beside
#                 our Triton backward, cuDNN (and FA4); WORKLOADS_PROVIDERS: another list (the forward's
#                 key-step A/B adds flashattn-fwd-k32,flashattn-fwd-k64,flashattn-fwd-k64s3,flashattn-fwd-k128);
#                 WORKLOADS_ARGS: bench options after the stage's (e.g. "--modes bwd --causal yes")
#   decode        the decode suite (eager and CUDA graph, contiguous and paged) beside SDPA (and FA4)
#   fp8           the fp8 suite (the FP8 forward, Triton and Gluon variants, beside our bf16 and SDPA-cuDNN;
#                 quantising's cost; the accuracy study) and the decode suite's FP8-cache rows beside the
#                 16-bit cache, at the issue's points (b16 64K/128K, b1 64K)
#   fp8-decode    the fp8 stage's FP8-cache rows alone
#   fp8-tiles     the fp8 suite's forward at 16K tokens (FP8_SEQLENS) on the Gluon FP8 variant with its
#                 table's tiles and the A/B ones (FP8_TILES: flashattn-fp8-k64, -k64s3, -k128s3, -m128,
#                 -m192; default the first four) beside our bf16 forward, cuDNN (and FA4)
#   decode-merge-ab
#                 the split kernel's merge over the packed rows beside the merge over the whole query block,
#                 batch 1 and 16, 4K-64K, contiguous and paged 64 (scripts/tune_decode_tiles.py --merge-ab)
#   decode-tiles-b1
#                 scripts/tune_decode_tiles.py at batch 1 (4K, 16K, 64K; contiguous and paged 64), 16-bit cache:
#                 tiles of two or three programs an SM beside split counts that fill them
#   decode-tiles-b16
#                 scripts/tune_decode_tiles.py at batch 16 (4K, 16K; contiguous and paged 64), 16-bit cache:
#                 every tile beside 2, 3 (the heuristic at 4K), 4 and 6 splits
#   decode-tiles-fp8
#                 scripts/tune_decode_tiles.py --fp8: the FP8 cache's tiles and split counts at b1/b16 64K,
#                 contiguous and paged 64, beside the 16-bit cache in the same process
#   cp            the cp suite on one GPU: each ring step's and Ulysses' local work measured, the multi-GPU
#                 times predicted from them and an assumed link (flashattn/bench/suites/cp.py says how)
#   qk-ahead      the Gluon forward's qk_ahead variant (tuning-log v87): the fp8 suite at 16K and the train
#                 suite's forward at 2K / 8K beside the same tiles without it, the default, cuDNN (and FA4);
#                 its tests are gpu-tests' (GPU_TESTS_K=ahead) and sanitize's (ws_ahead), in the call before
#   sparse        the sparse suite at 16K (SPARSE_SEQLENS: one run each), forward and forward + backward (SPARSE_MODES)
#                 beside flex (and flex on FA4's kernels), the block-sparse kernels (flashattn-sparse-kernels) and
#                 the same with the forward on the Gluon kernel's variant (flashattn-sparse-gluon-fwd) and
#                 with the backward on the Gluon backward's too (flashattn-sparse-gluon);
#                 SPARSE_PROVIDERS: another list (flex-fa4-sparse added with FA4)
#   profile-inference
#                 Nsight Compute on the FP8 forward beside the bf16 one (d 64/128/256, 16K tokens) and on decode
#                 steps (b1 4K/16K, b16 64K on a bf16 and an FP8 cache, contiguous and paged 64; b16 4K beside
#                 SDPA-cuDNN's kernel on the same cache): sections and pipe metrics, ncu-*.txt
#                 (PROFILE_CASES: a regex of case names)
#   profile-training
#                 Nsight Compute on one training backward (scripts/ncu_case.py; PROFILE_CASE, default the wide
#                 heads' "192 8192 causal dv=128") for ours and for cuDNN's (and FA4's) kernel on the same
#                 tensors: sections with source counters and the pipes, ncu-train-{ours,cudnn,fa4}.txt, and
#                 each SASS instruction's stall samples and shared wavefronts, sass-train-*.csv (read them
#                 with scripts/ncu_hotspots.py) (PROFILE_WHO: a subset of "ours cudnn fa4")
#   host-time     host time per call, layer by layer, beside SDPA-cuDNN (scripts/host_profile.py), and the
#                 autograd engine's share, device threads on and off (scripts/autograd_host.py)
#   host-steps    host time of each step of a repeated call, forward and backward, and cProfile's listing of
#                 the public forward and backward (scripts/host_steps.py)
#   host-ab       host time of this tree and of .baseline/src/flashattn_base (scripts/vendor_tree.sh) in one
#                 process, beside SDPA-cuDNN (scripts/host_ab.py)
#   decode-host   decode host time per call beside SDPA (scripts/decode_host_time.py)
#   upstream      flash_attn's own tests/test_flash_attn.py (carried in .upstream/) through flashattn.compat:
#                 the representative subset, its quotas scaled by UPSTREAM_SCALE, on UPSTREAM_N xdist workers
#                 (default 14: the cost is compiling, on the host's cores); UPSTREAM_SHARD=i/n runs the i-th
#                 of n interleaved shares (the subset takes ~9.5 minutes with two collections, over one call's limit)
#   baseline-train, baseline-decode, baseline-host
#                 the train table, the decode suite, the host time of the tree carried in .baseline/
#                 (`git archive REV src scripts | tar -x -C .baseline; echo REV > .baseline/REV`: the REV its
#                 results are labelled with), then of this tree, in the same call;
#                 the current tree's train table and decode suite beside cuDNN and FA4
# Time limits per stage: STAGE_S (seconds, default per stage below).
set -uo pipefail
OUT=${OUT:-/tmp/out}
RES="$OUT/res"
mkdir -p "$RES"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$RES/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# FA4 beside ours where its wheels came along: the libraries from an earlier call of this warm machine
# (fa4-libs), the wheels from this call's carried .fa4b. The libraries' archive with the working tree can
# pass the 64 MiB a call carries: then it travels split (`split -b 40M libs.tar.xz libs.tar.xz.`), the first
# part in .fa4a, the rest in .fa4b, and unpacks here once every part has come.
if [ -d /tmp/fa4parts ] && [ -d .fa4b ] && [ ! -d /tmp/fa4 ]; then
  cp .fa4b/libs.tar.xz.* /tmp/fa4parts/ 2>/dev/null
  mkdir -p /tmp/fa4 && cat /tmp/fa4parts/libs.tar.xz* | tar -C /tmp/fa4 -xJf - && echo "FA4 libraries unpacked"
fi
if [ -d /tmp/fa4 ] && [ -d .fa4b ]; then
  for w in .fa4b/*.whl; do python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/fa4')" "$w"; done
  FA4_PATH=:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages
  export PYTHONPATH=$PYTHONPATH$FA4_PATH
fi
FA4=$(python3 -c "import flash_attn.cute.interface" 2>/dev/null && echo ",fa4")
FA4_DECODE=${FA4:+,fa4-kvcache,fa4-kvcache-graph}

bench() {  # SECONDS NAME [bench options]: one bench run under $RES/NAME, the summary's tail
  timeout "$1" python3 -m flashattn bench --quiet --out "$RES/$2" "${@:3}" 2>&1 | tail -45
}

for stage in "$@"; do
  echo "== stage $stage"
  case "$stage" in
    fa4-libs)
      mkdir -p /tmp/fa4parts && cp .fa4a/libs.tar.xz* /tmp/fa4parts/ && echo "FA4 libraries stored" ;;
    gpu-tests)
      # GPU_TESTS: the test paths (default: all of tests/)
      # --results-log (tests/conftest.py): each outcome, its duration and a failure's report land as the
      # test ends, so a run cut off by its time limit still says what passed, what failed and why
      # the paths sorted: given as tests/backends/triton/a.py tests/b.py tests/backends/triton/c.py, the
      # device's pytest gave c.py's tests none of tests/backends/triton/conftest.py's fixtures (a.py's had them)
      timeout "${GPU_TESTS_S:-300}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider -n "${GPU_TESTS_N:-8}" \
        --results-log "$RES/gpu_results.log" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${GPU_TESTS_SHARD:+--shard "$GPU_TESTS_SHARD"} \
        $(printf '%s\n' ${GPU_TESTS:-tests} | sort) > "$RES/pytest_gpu.log" 2>&1
      grep -A15 -E "^(FAILED|ERROR)" "$RES/gpu_results.log" | head -60
      cut -d' ' -f1 "$RES/gpu_results.log" | sort | uniq -c
      tail -3 "$RES/pytest_gpu.log" ;;
    sanitize)
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # else the caching allocator hides out-of-bounds reads
      for case in ${SANITIZE_MEMCHECK-dense decode decode_bad sparse ws_bwd ws_wide_bwd ws_keys ws_padded ws_paged ws_features ws_ahead fp8 softcap_wide}; do
        timeout "${SANITIZE_S:-120}" compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py $case 2>&1 | tail -3 \
          | tee -a "$RES/memcheck.log"
      done
      for case in ${SANITIZE_RACECHECK-ws_fwd ws_bwd ws_wide_bwd ws_keys ws_features ws_ahead fp8 softcap_wide}; do
        # the full report per case: a hazard's kernel and addresses (the summary alone names neither)
        timeout "${SANITIZE_S:-120}" compute-sanitizer --tool racecheck --print-limit 40 python3 scripts/sanitize_cases.py \
          $case > "$RES/racecheck-$case.log" 2>&1
        tail -3 "$RES/racecheck-$case.log" | tee -a "$RES/racecheck.log"
      done
      # synccheck: barrier use in the backward kernels (a named barrier across both consumer warpgroups: v83)
      # the full report per case, as racecheck's: which barrier, which threads (the summary names neither)
      for case in ${SANITIZE_SYNCCHECK-ws_bwd ws_wide_bwd ws_keys}; do
        timeout "${SANITIZE_S:-120}" compute-sanitizer --tool synccheck --print-limit 40 python3 \
          scripts/sanitize_cases.py $case > "$RES/synccheck-$case.log" 2>&1
        tail -3 "$RES/synccheck-$case.log" | tee -a "$RES/synccheck.log"
      done
      unset PYTORCH_NO_CUDA_MEMORY_CACHING ;;
    fuzz-memcheck)
      timeout "${FUZZ_S:-540}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_fuzz.py -k memcheck \
        > "$RES/fuzz_memcheck.log" 2>&1
      tail -40 "$RES/fuzz_memcheck.log" ;;
    padded-heads)
      timeout 280 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 tests/backends/triton/test_gluon_padded_gpu.py \
        > "$RES/pytest_padded.log" 2>&1
      grep -E "^(FAILED|ERROR)" "$RES/pytest_padded.log" | head -20; tail -2 "$RES/pytest_padded.log"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py \
        ws_padded 2>&1 | tail -3 | tee "$RES/memcheck-padded.log"
      bench "${PADDED_S:-240}" padded --suite train --headdims 80,96 --modes fwd,bwd --seqlens 4096,16384 \
        --providers "flashattn,flashattn-gluon,sdpa-cudnn$FA4" ;;
    train-table)
      # .baseline/src on the path: TRAIN_PROVIDERS may name flashattn-baseline (scripts/vendor_tree.sh)
      PYTHONPATH=$PYTHONPATH:$PWD/.baseline/src bench "${TRAIN_S:-330}" train --suite train --headdims 64,128 \
        --modes "${TRAIN_MODES:-fwd,bwd}" ${TRAIN_SEQLENS:+--seqlens "$TRAIN_SEQLENS"} \
        --providers "${TRAIN_PROVIDERS:-flashattn,sdpa-cudnn$FA4}" ;;
    short)
      bench "${SHORT_S:-240}" short --suite short \
        --providers "flashattn,flashattn-short-split,flashattn-unpacked,sdpa-cudnn$FA4" ;;
    generate)
      bench "${GENERATE_S:-420}" generate --suite generate ;;
    paged)
      bench "${PAGED_S:-150}" paged-docs --suite workloads --modes fwd --causal yes \
        --providers "flashattn,flashattn-paged,flashattn-paged-gather$FA4"
      bench "${PAGED_S:-150}" paged-features --suite features --modes fwd --causal yes \
        --providers "flashattn-varlen,flashattn-paged,flashattn-paged-gather" ;;
    long-backward)
      bench "${LONG_S:-300}" long --suite memory --seqlens "${LONG_SEQLENS:-32768,65536,131072}" \
        --providers "flashattn,flashattn-triton-bwd,sdpa-cudnn" ;;
    workloads)
      bench "${WORKLOADS_S:-240}" workloads --suite workloads --modes fwd,bwd \
        --providers "${WORKLOADS_PROVIDERS:-flashattn,flashattn-triton-bwd,sdpa-cudnn$FA4}" ${WORKLOADS_ARGS:-} ;;
    ab-workloads)
      PYTHONPATH=$PYTHONPATH:$PWD/.baseline/src bench "${WORKLOADS_S:-300}" ab-workloads --suite workloads \
        --modes "${AB_MODES:-fwd,bwd}" --providers "flashattn,flashattn-baseline,sdpa-cudnn$FA4" ;;
    deterministic)
      timeout "${GPU_TESTS_S:-240}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider -n "${GPU_TESTS_N:-8}" \
        --results-log "$RES/gpu_results.log" -k deterministic tests/backends/triton > "$RES/pytest_gpu.log" 2>&1
      grep -A15 -E "^(FAILED|ERROR)" "$RES/gpu_results.log" | head -60
      cut -d' ' -f1 "$RES/gpu_results.log" | sort | uniq -c
      det=flashattn,flashattn-deterministic
      bench "${DET_S:-150}" det-train --suite train --headdims 64,128 --modes bwd --seqlens 4096,16384 \
        --providers "$det"
      bench "${DET_S:-150}" det-workloads --suite workloads --modes bwd --causal yes --providers "$det" ;;
    features)
      bench "${FEATURES_S:-240}" features --suite features --modes fwd,bwd --providers "flashattn,sdpa-cudnn$FA4" ;;
    decode)
      bench "${DECODE_S:-300}" decode --suite decode ${FA4:+--add-providers "${FA4_DECODE#,}"} ;;
    fp8|fp8-decode)
      [ "$stage" = fp8 ] && bench "${FP8_S:-360}" fp8 --suite fp8
      bench "${FP8_DECODE_S:-200}" fp8-decode --suite decode --seqlens 65536,131072 \
        --providers "flashattn-kvcache,flashattn-kvcache-graph,flashattn-fp8cache,flashattn-fp8cache-graph" ;;
    fp8-tiles)
      bench "${FP8_S:-300}" fp8-tiles --suite fp8 --modes fwd --seqlens "${FP8_SEQLENS:-16384}" \
        --providers "flashattn-fp8-gluon,${FP8_TILES:-flashattn-fp8-k64,flashattn-fp8-k128s3,flashattn-fp8-m128},flashattn,sdpa-cudnn$FA4" ;;
    qk-ahead)
      # the forward's next QK^T issued before the softmax (tuning-log v87): FP8 at 16K beside the same tiles
      # without it and the default, and the 16-bit train suite's forward beside the 64-key steps without it
      bench "${FP8_S:-200}" fp8-ahead --suite fp8 --modes fwd --seqlens 16384 --providers \
        "flashattn-fp8-gluon,flashattn-fp8-ahead-k64,flashattn-fp8-ahead-k64s3,flashattn-fp8-m128k64,flashattn,sdpa-cudnn$FA4"
      bench "${TRAIN_S:-200}" train-ahead --suite train --headdims 64,128 --modes fwd --seqlens 2048,8192 \
        --providers "flashattn,flashattn-fwd-ahead-k64,flashattn-fwd-k64,sdpa-cudnn$FA4" ;;
    sparse)
      # one bench run per length (sparse-N), so that a long one cut off by its limit keeps the shorter's
      for n in $(echo "${SPARSE_SEQLENS:-16384}" | tr , ' '); do
        bench "${SPARSE_S:-200}" "sparse-$n" --suite sparse --seqlens "$n" --modes "${SPARSE_MODES:-fwd,fwd+bwd}" \
          --providers "${SPARSE_PROVIDERS:-flashattn-sparse,flashattn-sparse-kernels,flashattn-sparse-gluon-fwd,flashattn-sparse-gluon,flashattn,flex-sparse}${FA4:+,flex-fa4-sparse}"
      done ;;
    decode-merge-ab)
      timeout "${TUNE_S:-200}" python3 scripts/tune_decode_tiles.py --merge-ab --batches 1,16 \
        --seqlens 4096,16384,65536 --pages none,64 --out "$RES/decode_merge_ab.json" 2>&1 | grep "^b=" ;;
    decode-tiles-b1)
      timeout "${TUNE_S:-300}" python3 scripts/tune_decode_tiles.py --batches 1 --seqlens 4096,16384,65536 \
        --pages none,64 --split-factors 0,2,3 --out "$RES/tune_decode_b1.json" 2>&1 | grep "^b=" ;;
    decode-tiles-b16)
      timeout "${TUNE_S:-200}" python3 scripts/tune_decode_tiles.py --batches 16 --seqlens 4096,16384 \
        --pages none,64 --split-factors 0,0.67,1.34,2 --out "$RES/tune_decode_b16.json" 2>&1 | grep "^b=" ;;
    decode-tiles-fp8)
      timeout "${TUNE_S:-300}" python3 scripts/tune_decode_tiles.py --fp8 --batches 16,1 --seqlens 65536 \
        --pages none,64 --split-factors 0,1.5,2 --out "$RES/tune_decode_fp8.json" 2>&1 | grep "^b=" ;;
    cp)
      bench "${CP_S:-240}" cp --suite cp ;;
    profile-inference)
      # PROFILE_CASES: a regex of case names (default all)
      cases=$(grep -E "^(${PROFILE_CASES:-.*}):" <<'CASES'
fp8-d128:attn_fwd:fwd 128 16384 fp8
bf16-d128:attn_fwd:fwd 128 16384
fp8-d256:attn_fwd:fwd 256 16384 fp8
bf16-d256:attn_fwd:fwd 256 16384
fp8-d64:attn_fwd:fwd 64 16384 fp8
decode-b1-4k:decode_kernel:decode 1 4096
decode-b1-16k:decode_kernel:decode 1 16384
decode-b16-64k:decode_kernel:decode 16 65536
decode-b16-64k-fp8:decode_kernel:decode 16 65536 fp8
decode-b16-64k-page64:decode_kernel:decode 16 65536 page=64
decode-b16-64k-fp8-page64:decode_kernel:decode 16 65536 fp8 page=64
decode-b16-4k:decode_kernel:decode 16 4096
decode-b16-4k-cudnn:sdpa:decode 16 4096 cudnn
CASES
)
      # compile every case first, side by side, so that each profiled process finds its kernels cached
      while IFS=: read -r name regex case; do
        timeout 240 python3 scripts/ncu_inference.py $case > "$RES/warm-$name.txt" 2>&1 &
      done <<< "$cases"
      wait
      pipes=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_active
      while IFS=: read -r name regex case; do
        timeout 120 ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 2 --launch-count 1 \
          --print-details all --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
          --section SchedulerStats --section SourceCounters python3 scripts/ncu_inference.py $case > "$RES/ncu-$name.txt" 2>&1
        timeout 60 ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 2 --launch-count 1 \
          --metrics "$pipes" python3 scripts/ncu_inference.py $case > "$RES/ncu-pipes-$name.txt" 2>&1
        echo "-- $name: $case"
        grep -E "^ +(Duration|Compute \(SM\) Throughput|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|sm__)" \
          "$RES/ncu-$name.txt" "$RES/ncu-pipes-$name.txt" | sed 's/^[^:]*://' | head -12
      done <<< "$cases" ;;
    profile-training)
      case_args=${PROFILE_CASE:-192 8192 causal dv=128}
      export PYTHONPATH=$PWD/src${FA4_PATH:-}  # ncu's child process (FA4 beside it where loaded)
      for who in ${PROFILE_WHO:-ours cudnn ${FA4:+fa4}}; do
        extra=; regex="attn_bwd_(ws|dsplit|keys)_kernel"
        [ $who = cudnn ] && extra=cudnn && regex=sdpa
        [ $who = fa4 ] && extra=fa4 && regex=BackwardSm90
        # one report, read twice: the sections as text, and the stall samples and shared-memory wavefronts
        # per SASS instruction (the source page; the report itself is too large to come back)
        timeout 200 ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section InstructionStats --section MemoryWorkloadAnalysis --section SchedulerStats \
          --section SourceCounters -o "/tmp/ncu-$who" -f python3 scripts/ncu_case.py $case_args $extra \
          > "$RES/ncu-run-$who.txt" 2>&1
        ncu -i "/tmp/ncu-$who.ncu-rep" --print-details all > "$RES/ncu-train-$who.txt" 2>&1
        ncu -i "/tmp/ncu-$who.ncu-rep" --page source --csv --print-source sass > "$RES/sass-train-$who.csv" 2>&1
        echo "-- $who: $case_args"
        grep -E "^ +(Duration|Compute \(SM\) Throughput|L2 Cache Throughput|Issue Slots Busy|Stall Long)" \
          "$RES/ncu-train-$who.txt" | head -8
      done ;;
    host-time)
      timeout 120 python3 scripts/host_profile.py "$RES/host_time.json" 2>&1 | grep "us/call"
      timeout 60 python3 scripts/autograd_host.py "$RES/autograd_host.json" 2>&1 | grep "us/call" ;;
    host-steps)
      timeout 150 python3 scripts/host_steps.py "$RES/host_steps.json" "$RES/host_steps_profile.txt" 2>&1 \
        | tail -40 ;;
    host-ab)
      PYTHONPATH=$PYTHONPATH:$PWD/.baseline/src timeout 200 python3 scripts/host_ab.py "$RES/host_ab.json" \
        flashattn_base 2>&1 | tail -12 ;;
    decode-host)
      timeout 120 python3 scripts/decode_host_time.py "$RES/decode_host_time.json" 2>&1 | tail -12 ;;
    upstream)
      # SIGINT at the limit: pytest stops and still prints its summary of what ran
      UPSTREAM_SCALE=${UPSTREAM_SCALE:-1} timeout -s INT -k 30 "${UPSTREAM_S:-540}" \
        bash scripts/upstream_flash_attn_tests.sh .upstream/test_flash_attn.py subset \
        -n "${UPSTREAM_N:-14}" --durations=20 2>&1 | tail -45
      cp .upstream/run/pytest.log "$RES/upstream_pytest.log" 2>/dev/null ;;
    baseline-train|baseline-decode|baseline-host)
      # the same measurement of the baseline tree, then of this one: one process each, in this call
      what=${stage#baseline-}
      for tree in baseline current; do
        src=$PWD/src; scripts=scripts; extra=; sha=${FLASHATTN_GIT_SHA:-}
        if [ $tree = baseline ]; then
          src=$PWD/.baseline/src; scripts=.baseline/scripts; sha=$(cat .baseline/REV 2>/dev/null || echo baseline)
        fi
        case $what in
          train)
            # the current tree beside cuDNN and FA4 (run fa4-libs first, carrying .fa4a and .fa4b)
            [ $tree = current ] && extra=,sdpa-cudnn$FA4
            FLASHATTN_GIT_SHA=$sha PYTHONPATH=$src${FA4_PATH:-} timeout 170 python3 -m flashattn bench --quiet --out "$RES/$tree-train" \
              --suite train --headdims 64,128 --modes fwd,bwd --providers "flashattn$extra" 2>&1 | tail -25 ;;
          decode)
            [ $tree = current ] && extra=,sdpa-cudnn$FA4_DECODE
            FLASHATTN_GIT_SHA=$sha PYTHONPATH=$src${FA4_PATH:-} timeout 120 python3 -m flashattn bench --quiet --out "$RES/$tree-decode" \
              --suite decode --providers "flashattn-kvcache,flashattn-kvcache-graph$extra" 2>&1 | tail -25 ;;
          host)
            PYTHONPATH=$src timeout 90 python3 $scripts/host_profile.py "$RES/$tree-host_time.json" 2>&1 \
              | grep "us/call" ;;
        esac
      done ;;
    *)
      echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar -C "$OUT" -czf "$OUT/res.tgz" res && rm -rf "$RES"
