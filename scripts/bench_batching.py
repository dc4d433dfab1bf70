"""The five batching strategies on one workload, side by side: `jaxserve.bench.batching` (its
docstring has the options), here as a script.

    python scripts/bench_batching.py --num-requests 64 --input-len 32:256 --output-len 128:128
"""

from jaxserve.bench.batching import main

if __name__ == "__main__":
    main()
