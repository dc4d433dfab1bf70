#!/bin/bash
# The checks that need a GPU, in one run, on a CUDA machine with jax[cuda], torch and transformers
# installed (the real weights need not be there: the speed runs use random Gemma 3 270M shapes).
#   1. the GPU kernel's tests, compiled for the GPU instead of interpreted;
#   2. the engine's Hugging Face parity under several token budgets, with the Pallas kernel inside;
#   3. the kernel benchmark (ours vs the jnp reference vs jax's shipped decode kernel), with and
#      without kv splits;
#   4. decode tokens/s against batch size, and the batching benchmark, on random Gemma 3 270M.
#   5. start-up: every step program compiled cold (and loaded warm) on random Gemma 3 270M.
# Each part has its own time limit, so one slow part cannot take the others' time; together they
# stay under 8 minutes, the lent machine's start-up included.
#   OUT=results bash scripts/gpu_checks.sh
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHON=${PYTHON:-python3} JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
part() {  # part NAME SECONDS COMMAND...: runs COMMAND, logs to $OUT/NAME.log, prints its tail
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "--- rc $? in $((SECONDS - t0)) s"
    tail -n "${TAIL:-16}" "$OUT/$name.log"
}
nvidia-smi -L
$PYTHON -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
part kernel_tests 70 $PYTHON -m pytest -q -p no:cacheprovider tests/test_pallas_ragged_attention.py -k "gpu and not export"
JAX_DEFAULT_MATMUL_PRECISION=highest part engine_parity 60 $PYTHON -m pytest -q -p no:cacheprovider tests/test_token_budget.py
part bench_kernels 60 $PYTHON scripts/bench_kernels.py --json "$OUT/kernels.json"
part bench_kernels_no_splits 40 $PYTHON scripts/bench_kernels.py --kv-splits 1
$PYTHON scripts/random_checkpoint.py /tmp/gemma3-270m-random >/dev/null 2>&1
export JAXSERVE_CACHE=/tmp/jaxserve-cache  # empty: the first engine compiles, the later ones load
part startup_cold 60 $PYTHON scripts/bench_startup.py --warmup
part bench_decode 80 $PYTHON scripts/bench_decode.py --model /tmp/gemma3-270m-random --batches 1,8,64,256 --context 1024 --reps 10
part bench_batching 100 $PYTHON scripts/bench_batching.py --model /tmp/gemma3-270m-random --strategies none,paged \
    --num-requests 32 --max-slots 32 --peer hf --json "$OUT/batching.json"
