#!/bin/bash
# The checks that need a GPU, in one run, on a CUDA machine with jax[cuda], torch and transformers
# installed (the real weights need not be there: the speed runs use random Gemma 3 270M shapes).
#   1. the GPU kernel's tests, compiled for the GPU instead of interpreted;
#   2. the engine's Hugging Face parity under several token budgets, with the Pallas kernel inside;
#   3. with KERNEL_BENCH=1, the kernel benchmark (ours vs the jnp reference vs jax's shipped decode
#      kernel; `--kv-splits 1` runs ours without kv splits);
#   4. the host's CPU time per step at 1 to 256 decoding sequences under a 32k context, with a
#      jax.profiler trace of those steps (jaxserve.bench.host_cost, by phase), the bookkeeping alone at
#      256 (this host's CPU without the device), single steps and 4 decode steps per dispatch, and
#      the device's busy share read from those traces (jaxserve.bench.trace_busy);
#      the batching benchmark (one request, and 32, traced) with 1 and 4 decode steps per dispatch,
#      and decode tokens/s against batch size in bfloat16 and int8, on random Gemma 3 270M;
#   5. start-up: `jaxserve generate` cold (empty cache) and warm, on random Gemma 3 270M;
#   6. with RAY_BENCH=1, replicas behind Ray Serve against one engine (`load.py replicas`).
#   7. with SPEC_BENCH=1, speculative decoding with the model drafting for itself (every draft kept:
#      the most a verifying step can give on this GPU) against none (`bench_speculative.py`).
# The host and step figures (4) run first, then start-up (5): the kernel's figures are in
# docs/kernels.md already, and a run cut short by the device tool's limit loses the least.
# The tests run in one process (-n 0): xdist workers would each take most of the GPU memory.
# Each part has its own time limit, so one slow part cannot take the others' time; together they
# stay under 10 minutes (8.5 at most, without KERNEL_BENCH): the device tool's limit for a command.
#   OUT=results bash scripts/gpu_checks.sh
# Each part's log goes to $LOGS; on exit they are packed into $OUT/gpu-logs.tgz (one file: the
# device tool brings back at most 8).
set -u
OUT=${OUT:-gpu-results} LOGS=${LOGS:-/tmp/gpu-logs}
mkdir -p "$OUT" "$LOGS"
trap 'tar czf "$OUT/gpu-logs.tgz" -C "$LOGS" .' EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHON=${PYTHON:-python3} JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
part() {  # part NAME SECONDS COMMAND...: runs COMMAND, logs to $LOGS/NAME.log, prints its tail
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    echo "--- rc $? in $((SECONDS - t0)) s"
    tail -n "${TAIL:-16}" "$LOGS/$name.log"
}
nvidia-smi -L
$PYTHON -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
part random_checkpoint 40 $PYTHON scripts/random_checkpoint.py /tmp/gemma3-270m-random
part host_cost 75 $PYTHON -m jaxserve.bench.host_cost --sequences 1,8,64,256 --steps 20 --breakdown --trace "$LOGS/trace"
part host_bookkeeping 30 $PYTHON -m jaxserve.bench.host_cost --bookkeeping --sequences 256 --steps 200
part host_cost_steps 45 $PYTHON -m jaxserve.bench.host_cost --sequences 1,64 --steps 20 --decode-steps 4 --trace "$LOGS/trace-steps"
# Command buffers (CUDA graphs) off, against the default above (XLA has captured Pallas's Triton
# calls by default since openxla/xla#30765; jax issue 27988 needed a flag before).
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" part host_cost_no_command_buffers 45 \
    $PYTHON -m jaxserve.bench.host_cost --sequences 1,64 --steps 20
part trace_busy 30 bash -c "for d in $LOGS/trace/*/ $LOGS/trace-steps/*/; do echo \$d; $PYTHON -m jaxserve.bench.trace_busy \$d --top 12; done"
part decode_one_request 60 $PYTHON scripts/bench_batching.py --model /tmp/gemma3-270m-random --strategies paged \
    --num-requests 1 --output-len 256:256 --max-slots 8 --decode-steps 1,4
part bench_batching 120 $PYTHON scripts/bench_batching.py --model /tmp/gemma3-270m-random --strategies paged \
    --num-requests 32 --max-slots 32 --decode-steps 1,4 --peer hf --json "$LOGS/batching.json" --trace "$LOGS/trace-batching"
# int8's first start rounds the random model's layers by GPTQ (about 40 s on a 2-core CPU), so this part has more time.
part bench_decode 150 $PYTHON scripts/bench_decode.py --model /tmp/gemma3-270m-random --batches 1,64,256 --context 1024 --reps 10 \
    --dtypes auto --quantizations none,int8
# Start-up with caches of its own: empty for the first run, which compiles, and the second loads.
export JAXSERVE_CACHE=/tmp/jaxserve-startup JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache-startup
part generate_cold 60 $PYTHON -m jaxserve.entrypoints.cli generate --model /tmp/gemma3-270m-random "w1 w2 w3" --max-tokens 32
part generate_warm 30 $PYTHON -m jaxserve.entrypoints.cli generate --model /tmp/gemma3-270m-random "w1 w2 w3" --max-tokens 32
part kernel_tests 70 $PYTHON -m pytest -q -p no:cacheprovider -n 0 tests/test_pallas_ragged_attention.py -k "gpu and not export"
JAX_DEFAULT_MATMUL_PRECISION=highest part engine_parity 90 $PYTHON -m pytest -q -p no:cacheprovider -n 0 tests/test_token_budget.py
if [ "${KERNEL_BENCH:-0}" = 1 ]; then part bench_kernels 60 $PYTHON scripts/bench_kernels.py --json "$LOGS/kernels.json"; fi
if [ "${SPEC_BENCH:-0}" = 1 ]; then part bench_speculative 150 $PYTHON scripts/bench_speculative.py --model /tmp/gemma3-270m-random \
    --draft-model /tmp/gemma3-270m-random --parts grounded --new-tokens 64; fi
# With RAY_BENCH=1 (needs jaxserve[ray]; about 6 more minutes): Ray Serve's overhead and prefix
# affinity (docs/scale-out.md). A fifth of the GPU's memory per engine: two replicas share one GPU.
if [ "${RAY_BENCH:-0}" = 1 ]; then
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
    replicas=(scripts/load.py replicas --serve "--model /tmp/gemma3-270m-random --max-slots 16 --max-model-len 1024 --kv-cache-mb 2048")
    part bench_replicas_overhead 300 $PYTHON "${replicas[@]}" --configs direct,ray-1,direct,ray-1 --repeats 2 --json "$LOGS/overhead.json"
    part bench_replicas_affinity 150 $PYTHON "${replicas[@]}" --configs direct,prefix,round-robin --json "$LOGS/affinity.json"
fi
