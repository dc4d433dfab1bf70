"""The compiled forward of the default model and config writes the KV pool in place: no bucket's
optimized program copies the pool (inside the layer loop a copy costs a pool's worth of memory
traffic per layer and step). Gemma 3 270M has one kv head, so its one-token write is a single
index, the form XLA copied."""

import math
import re

import pytest

from jaxserve import Engine, EngineConfig

pytestmark = pytest.mark.slow


def pool_copies(hlo: str, pool_size: int) -> int:
    shapes = re.findall(r"= \w+\[([0-9,]*)\]\{[0-9,]*\} copy\(", hlo)
    return sum(math.prod(int(d) for d in s.split(",") if d) == pool_size for s in shapes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_forward_program_copies_the_kv_pool(dtype):
    engine = Engine.from_pretrained(None, EngineConfig(dtype=dtype))  # the default model, as users get it
    runner = engine.runner
    pool_size = math.prod(runner.kv_pool[0].shape)
    forwards = [key for key in runner.all_programs() if key[0] == "forward"]
    for key in forwards[:2] + forwards[-1:]:  # one and two rows (decode), and the whole budget
        jitted, args = runner.program(key)
        assert pool_copies(jitted.lower(*args).compile().as_text(), pool_size) == 0, key
