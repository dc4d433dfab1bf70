"""Helpers shared by the model tests."""

import jax.numpy as jnp
import numpy as np

from jaxserve.kv_pool import allocate_kv_pool
from jaxserve.model.transformer import Transformer

PAGE = 8


def paged_logits(model: Transformer, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    """Logits [len(tokens), V]: prefill of the prompt, then one decode step per further token."""
    pages_needed = -(-len(tokens) // PAGE)
    pool = allocate_kv_pool(model.cfg, 32, PAGE, jnp.float32)
    table = np.random.RandomState(1).permutation(np.arange(1, 32))[:pages_needed][None].astype(np.int32)
    positions = np.arange(prompt_len, dtype=np.int32)[None]
    logits, pool = model(tokens[None, :prompt_len], positions, pool, table, np.array([prompt_len], np.int32),
                         decode=False)
    rows = [np.asarray(logits[0])]
    for t in range(prompt_len, len(tokens)):
        logits, pool = model(tokens[None, t: t + 1], np.array([[t]], np.int32), pool, table,
                             np.array([t + 1], np.int32), decode=True)
        rows.append(np.asarray(logits[0]))
    return np.concatenate(rows)
