#!/usr/bin/env bash
# Everything the GPU has to show, in one device call. Writes logs and JSON under $OUT.
#   bash scripts/device_check.sh tune     correctness check, sanitizers, config sweep
#   bash scripts/device_check.sh full     gpu tests, benchmark suites (train, memory, features)
#   bash scripts/device_check.sh decode|sparse|ecosystem|io   one call per issue still without GPU evidence
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
stage=${1:-full}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

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

# what the 2026-11-29 session could not run for lack of device time (issues 4, 5, 6, 8): one call each
if [ "$stage" = decode ]; then
  mkdir -p "$OUT/res"
  timeout 150 python3 -m pytest -m gpu -q -rs tests/test_decode_gpu.py 2>&1 | tee "$OUT/res/pytest_decode.log" | tail -15
  timeout 400 python3 -m flashattn bench --suite decode --quiet --no-plots --out "$OUT/res/decode" 2>&1 | tail -30
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = sparse ]; then
  mkdir -p "$OUT/res"
  timeout 150 python3 -m pytest -m gpu -q -rs -s tests/test_block_sparse_gpu.py 2>&1 | tee "$OUT/res/pytest_sparse.log" | tail -15
  timeout 400 python3 -m flashattn bench --suite sparse --quiet --no-plots --out "$OUT/res/sparse" 2>&1 | tail -30
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = ecosystem ]; then
  mkdir -p "$OUT/res"
  timeout 200 python3 -m pytest -m gpu -q -rs tests/test_modules.py tests/test_transformers.py tests/test_compile.py \
    tests/test_e2e_gpu.py tests/test_features_triton.py 2>&1 | tee "$OUT/res/pytest_eco.log" | tail -15
  timeout 350 python3 -m flashattn bench --suite e2e --quick --out "$OUT/res/e2e" 2>&1 | tail -30
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
if [ "$stage" = io ]; then
  mkdir -p "$OUT/res"
  timeout 500 python3 scripts/ncu_io.py --quick --out "$OUT/res/ncu" 2>&1 | tail -30
  tar -C "$OUT" -czf "$OUT/res.tgz" res
fi
