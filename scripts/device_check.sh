#!/usr/bin/env bash
# Everything the GPU has to show, in one device call. Writes logs and JSON under $OUT.
#   bash scripts/device_check.sh tune     correctness check, sanitizers, config sweep
#   bash scripts/device_check.sh full     gpu tests, benchmark suites (train, memory), io measurement
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
