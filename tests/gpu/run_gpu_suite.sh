#!/usr/bin/env bash
# The GPU suite and benchmarks on the GPU machine (device tool), in as few calls as possible:
#   WHAT=tests bash tests/gpu/run_gpu_suite.sh     # every test (CPU ones too) on CUDA + the state machine on CUDA
#   WHAT=bench bash tests/gpu/run_gpu_suite.sh     # torch, megatron, fsdp2, checkpoint benchmarks
#   WHAT=tms bash tests/gpu/run_gpu_suite.sh       # address-stable mode vs torch_memory_saver
#   WHAT=verl bash tests/gpu/run_gpu_suite.sh      # verl 0.9.1's functions vs the drop-ins (.whl-verl/ carried; VERL_ARGS for the bench)
#   WHAT=sync bash tests/gpu/run_gpu_suite.sh      # weight sync between processes: tests, then the bench (SYNC_FAMILIES, SYNC_ARGS, SYNC_ARGS_<family>)
#   WHAT=executors bash tests/gpu/run_gpu_suite.sh # stateshift train's rollouter in a process / under Ray: tests, then the bench
#   WHAT=longtail bash tests/gpu/run_gpu_suite.sh  # sync vs fully-async on the long-tail task (LONGTAIL_ARGS)
#   WHAT=families bash tests/gpu/run_gpu_suite.sh  # stateshift train per model family x 3 seeds, with its checks (FAMILIES_ARGS)
# Ray travels as .ray/ray-core.tar.xz plus its needs' wheels (docs/notes/gpu-machine.md), unpacked into /tmp/site.
# Pass STATESHIFT_GIT_SHA=<the commit here> on the device: its copy of the tree may carry a stale .git.
# Results go to $OUT (default ./gpu-out) as one results.tgz plus run.log (the device tool returns <= 8 files).
# megatron-core, torch_memory_saver and zlib-ng travel as wheels in .whl/ (docs/notes/gpu-machine.md), installed into
# .site/: carry .whl on every call (stateshift imports zlib_ng; without it every step fails, and the script exits 1).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
RES=$PWD/.gpu-results
rm -rf "$RES" && mkdir -p "$OUT" "$RES"
# the commit result files record: the device's copy of the tree may carry a stale .git, so the caller may set it
export STATESHIFT_GIT_SHA=${STATESHIFT_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    && export PYTHONPATH=$PWD/.site:$PYTHONPATH
fi
if [[ -f .ray/ray-core.tar.xz ]]; then
  mkdir -p /tmp/site && tar xJf .ray/ray-core.tar.xz -C /tmp/site && chmod -R a+x /tmp/site/ray/core \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ray/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
GPU_TESTS_PATH=$PWD/tests:$PWD/tests/rl
DAY=$(date +%F)
WHAT=${WHAT:-tests,bench}
status=0
step() { echo "=== $* ($(date +%T))"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__)"
python3 -c "import zlib_ng" 2>/dev/null \
  || { echo "run_gpu_suite: zlib_ng (a dependency of stateshift) is not importable here: carry .whl"; status=1; }
if [[ $WHAT == *tests* ]]; then
  step pytest
  python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" ${TESTS:-tests} --ignore=tests/core/test_state_machine.py \
    --junitxml="$RES/gpu-tests.xml" -o junit_family=xunit2 > "$RES/gpu-tests.log" 2>&1 || status=1
  tail -30 "$RES/gpu-tests.log"
  step state machine on cuda
  STATESHIFT_TEST_DEVICE=cuda STATESHIFT_MACHINE_EXAMPLES=15 python3 -m pytest -q -p no:cacheprovider \
    tests/core/test_state_machine.py 2>&1 | tail -3 || status=1
  step profile
  python3 benchmarks/profile_small.py 2>&1 | head -30
fi
if [[ $WHAT == *tms* ]]; then
  step address-stable bench
  timeout 240 python3 benchmarks/tms_bench.py --out "$RES" 2>&1 | tail -60 || status=1
fi
if [[ $WHAT == *bench* ]]; then
  step torch bench
  python3 benchmarks/verbs_bench.py --no-progress --layers 6 --width 4096 --heads 32 --vocab 32000 --dtype bf16 \
    --small-tensors 2000 --small-numel 262144 --repeat 5 \
    --json "$RES/$DAY-h200-torch.json" --plot "$RES/$DAY-h200-torch.png" 2>&1 || status=1
  for b in ${BENCHES:-megatron fsdp2 checkpoint}; do
    if [[ -f benchmarks/${b}_bench.py ]]; then
      step "$b bench"
      case $b in
        megatron) args=""; limit=230 ;;
        checkpoint) args="--hidden 1024 --layers 8 --repeat 3"; limit=200 ;;
        weight_sync) args=""; limit=560 ;;  # not in the default list: BENCHES=weight_sync
        *) args=""; limit=110 ;;
      esac
      timeout $limit python3 benchmarks/${b}_bench.py --out "$RES" $args 2>&1 | tail -40 || status=1
    fi
  done
fi
if [[ $WHAT == *verl* ]]; then  # needs .whl-verl/verl-0.9.1-py3-none-any.whl carried (docs/guide/verl.md)
  step verl gpu test
  # whole logs go into results.tgz; run.log gets their tails
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_verl_gpu.py 2>&1 | tee "$RES/verl-gpu-test.log" | tail -40 || status=1
  step verl bench
  timeout 300 python3 benchmarks/verl_bench.py --out "$RES" ${VERL_ARGS:-} 2>&1 | tee "$RES/verl-bench.log" | grep -v '^{' | tail -60 || status=1
fi
if [[ $WHAT == *sync* ]]; then
  step weight sync gpu tests
  PYTHONPATH=$PYTHONPATH:$GPU_TESTS_PATH timeout ${SYNC_TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    tests/gpu/test_sync_gpu.py 2>&1 | tee "$RES/sync-gpu-test.log" | tail -25 || status=1
  for fam in ${SYNC_FAMILIES:-torch fsdp2 megatron}; do
    step "weight sync bench $fam"
    mkdir -p "$RES/ws-$fam"
    fam_args=SYNC_ARGS_${fam//-/_}  # per family, e.g. SYNC_ARGS_megatron=--no-ray-naive (fsdp2-3b: SYNC_ARGS_fsdp2_3b)
    timeout ${SYNC_BENCH_S:-200} python3 benchmarks/weight_sync_bench.py --families "$fam" --out "$RES/ws-$fam" ${SYNC_ARGS:-} ${!fam_args:-} 2>&1 \
      | tee "$RES/ws-$fam/bench.log" | tail -15 || status=1
    # a bench the timeout killed leaves Ray's processes (and the GPU memory their workers map) to the next family
    pkill -9 -f '/tmp/site/ray/' 2>/dev/null || true
  done
fi
if [[ $WHAT == *executors* ]]; then
  step executor gpu tests
  PYTHONPATH=$PYTHONPATH:$GPU_TESTS_PATH timeout ${EXEC_TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu \
    ${EXEC_TESTS:-tests/gpu/test_rl_gpu_executors.py} 2>&1 | tee "$RES/executors-gpu-test.log" | tail -25 || status=1
  step train executors bench
  timeout ${EXEC_BENCH_S:-330} python3 benchmarks/train_executors_bench.py --out "$RES" ${EXEC_ARGS:-} 2>&1 \
    | tee "$RES/executors-bench.log" | tail -30 || status=1
fi
if [[ $WHAT == *longtail* ]]; then
  step longtail bench
  # --stop-by-s: end between seeds, with the file and its plot whole, before the timeout would cut a seed
  timeout ${LONGTAIL_S:-540} python3 benchmarks/longtail_bench.py --out "$RES" --stop-by-s $((${LONGTAIL_S:-540} - 20)) \
    ${LONGTAIL_ARGS:-} 2>&1 \
    | tee "$RES/longtail-bench.log" | tail -40 || status=1
fi
if [[ $WHAT == *families* ]]; then
  step train families bench
  timeout ${FAMILIES_S:-540} python3 benchmarks/train_families_bench.py --out "$RES" ${FAMILIES_ARGS:-} 2>&1 \
    | tee "$RES/families-bench.log" | tail -40 || status=1
fi
echo $status > "$RES/.status"  # (this block is a pipeline's subshell: its variables do not reach the exit below)
} 2>&1 | tee "$OUT/run.log"
status=$(cat "$RES/.status" 2>/dev/null || echo 1)
rm -f "$RES/.status"
tar -czf "$OUT/results.tgz" -C "$RES" .
[[ $status == 0 ]] || echo "run_gpu_suite: a step failed (see run.log)" >&2
exit $status
