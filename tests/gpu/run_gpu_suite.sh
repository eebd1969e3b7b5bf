#!/usr/bin/env bash
# The GPU suite and benchmarks, in one call on the GPU machine (device tool):
#   bash tests/gpu/run_gpu_suite.sh            # results under $OUT (default ./gpu-out)
# Carries megatron-core as a wheel in .whl/ (see ../shared/GPU.md); installs it into .site/.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    && export PYTHONPATH=$PWD/.site:$PYTHONPATH
fi
DAY=$(date +%F)
WHAT=${WHAT:-tests,bench}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
if [[ $WHAT == *tests* ]]; then
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} --ignore=tests/test_state_machine.py \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" | tail -25 || status=1
  STATESHIFT_TEST_DEVICE=cuda STATESHIFT_MACHINE_EXAMPLES=15 python3 -m pytest -q -p no:cacheprovider \
    tests/test_state_machine.py 2>&1 | tail -3 | tee -a "$OUT/gpu-tests.log" || status=1
fi
if [[ $WHAT == *bench* ]]; then
  python3 -m stateshift.cli bench --no-progress --layers 6 --hidden 4096 --heads 32 --vocab 32000 --dtype bf16 \
    --small-tensors 4000 --small-numel 65536 --repeat 5 \
    --json "$OUT/$DAY-h200-torch.json" --plot "$OUT/$DAY-h200-torch.png" 2>&1 | tee "$OUT/bench-torch.log" || status=1
fi
exit $status
