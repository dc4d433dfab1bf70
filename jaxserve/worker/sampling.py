"""On-device token sampling, one row per sequence: greedy, temperature, top-k, top-p and min-p.

Each row's key is derived from the request's seed and the position of the token being sampled,
so a request draws the same tokens whatever else shares its batch. A row constrained to a
grammar (structured output) first has the tokens its bitmask forbids set to -inf, so no cut and no
greedy pick can reach them.

What a batch needs is known on the host before the step: the host picks the program's `mode`
(`sampling_mode`: all greedy, a temperature, or cuts), so the device never decides which path a
batch takes. Inside a program, the choices left (a batch with a constrained row, cuts found
inside the search window or not) go through `branch`: a `lax.cond` on XLA:CPU, where it skips
work and costs nothing, and both sides with a select on accelerators, where XLA copies a
conditional's predicate to the host and waits for it (XLA:GPU's conditional thunk), which would
stall the dispatch of every step.
Legend: B rows, V vocab, M = ceil(V / 32) mask words.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("greedy", "random", "cuts")  # what a batch's rows ask, each a program of its own
STOP_IDS = 8  # the token ids a slot keeps on the device that end its request (multi-step decode)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling parameters, all [B]."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    seed: jax.Array  # uint32
    stop_ids: jax.Array | None = None  # [B, STOP_IDS] int32: the ids that end each row's request, -1 pads

    @classmethod
    def from_table(cls, table) -> "SamplingBatch":
        """Host arrays of a scheduler `SlotTable`, a row per slot."""
        return cls(table.temperature, table.top_k, table.top_p, table.min_p, table.seed, table.stop_ids)

    @classmethod
    def greedy(cls, rows: int) -> "SamplingBatch":
        """Host rows [rows] that pick the most likely token, with no cut (no sorting path)."""
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                   np.zeros(rows, np.float32), np.zeros(rows, np.uint32), np.full((rows, STOP_IDS), -1, np.int32))

    def at(self, rows) -> "SamplingBatch":
        """The rows `rows` of every field."""
        return jax.tree.map(lambda x: x[rows], self)


def sampling_mode(params: SamplingBatch, vocab: int) -> str:
    """The program a batch of host rows [B] (padding rows too) needs: "greedy" (every row),
    "random" (a temperature, and no top-k, top-p or min-p cut in any row) or "cuts"."""
    if np.all(np.asarray(params.temperature) == 0):
        return "greedy"
    top_k = np.asarray(params.top_k)
    cuts = ((top_k > 0) & (top_k < vocab)) | (np.asarray(params.top_p) < 1) | (np.asarray(params.min_p) > 0)
    return "cuts" if np.any(cuts) else "random"


def conditionals_skip_work() -> bool:
    """Whether a `lax.cond` costs no more than the branch it runs: on XLA:CPU, where the
    predicate is already in host memory. Elsewhere it costs a device-to-host copy and a wait."""
    return jax.default_backend() == "cpu"


def branch(pred: jax.Array, on_true, on_false):
    """`on_true()` where pred, else `on_false()`: a conditional where conditionals skip work, both
    sides and a select elsewhere (see the module's docstring)."""
    if conditionals_skip_work():
        return jax.lax.cond(pred, on_true, on_false)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true(), on_false())


def sample(logits: jax.Array, params: SamplingBatch, positions: jax.Array,
           allowed: jax.Array | None = None, mode: str = "cuts") -> jax.Array:
    """logits: [B, V] float32; positions: [B] index of the token being sampled; allowed: [B, M]
    int32 bitmasks of the tokens each row may draw (all bits set: any), or None; `mode`: the
    batch's `sampling_mode` (or one that covers it: "cuts" covers all). Returns [B] int32."""
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    greedy = argmax(logits)
    if mode == "greedy":
        return greedy
    # Drawn once here, not in each path: threefry is hundreds of operations to compile.
    u = row_uniforms(params.seed, positions)
    drawn = (categorical(u, logits, 1 / jnp.maximum(params.temperature, 1e-6)) if mode == "random"
             else _sample_with_cuts(u, logits, params))
    return jnp.where(params.temperature == 0, greedy, drawn)


def mask_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens that allowed [B, M] forbids set to -inf: token t of row b is
    allowed when bit t % 32 of allowed[b, t // 32] is set (llguidance's layout). A batch without a
    constrained row (every word -1) skips the pass over the vocabulary."""
    b, v = logits.shape

    def masked():
        bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, M, 32]
        return jnp.where(bits.reshape(b, -1)[:, :v] == 1, logits, -jnp.inf)
    return branch(jnp.any(allowed != -1), masked, lambda: logits)


def argmax(logits: jax.Array, chunk: int = 512) -> jax.Array:
    """Row-wise argmax [B] (first maximum wins), as two small reductions over [B, V/chunk, chunk]:
    on CPU this is ~15x faster than one variadic argmax reduction over a 262k vocabulary."""
    b, v = logits.shape
    if v <= chunk:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    pad = -v % chunk
    chunks = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, chunk)
    best_chunk = jnp.argmax(chunks.max(axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(chunks, best_chunk[:, None, None], axis=1)[:, 0], axis=-1)
    return (best_chunk * chunk + within).astype(jnp.int32)


def row_uniforms(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """The uniform number in [0, 1) that each row [B] draws with: from its key, the request's
    seed folded with the position of the token being sampled."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, positions)
    return jax.vmap(jax.random.uniform)(keys)


def _sample_with_cuts(u, logits, params: SamplingBatch):
    """A draw per row [B] with its uniform number u, under its top-k, top-p and min-p cuts."""
    top_k = _top_k_or_vocab(params.top_k, logits.shape[-1])
    cuts = (top_k < logits.shape[-1]) | (params.top_p < 1)
    scaled = logits * (1 / jnp.maximum(params.temperature, 1e-6))[:, None]
    # A batch whose only cut is min-p has no threshold to find.
    return branch(jnp.any(cuts), lambda: _draw_filtered(u, scaled, top_k, params.top_p, params.min_p),
                  lambda: categorical(u, _min_p_filter(scaled, params.min_p)))


def _top_k_or_vocab(top_k, vocab):
    """top_k [B] with "off" (0, or at least the vocabulary) as the vocabulary size."""
    return jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)


SEARCH_WINDOW = 2048  # each row's largest logits (lax.top_k), where the cuts are looked for first
TOP_K_WINDOW = 256  # ... or fewer, when every row's top-k is below it (on CPU, 2-3x faster than 2048)


def _filter(scaled, top_k, top_p, min_p, window: int = SEARCH_WINDOW, largest=None):
    """Rows of scaled logits [B, V] with what top-k, then top-p (on the renormalized rest), then
    min-p (against the best token) drop set to -inf; tokens tied at a cut are all kept.

    The cuts are read off each row's `window` largest logits (lax.top_k of 2048 over a 262k
    vocabulary costs on CPU about 1/60 of sorting it; `largest`: those already found). A row
    whose cut lies beyond its window (top-k above it, or a longer nucleus: at top-p 0.9 Gemma 3
    270M's nucleus held up to 641 tokens after prefixes of a story, up to 1674 after random
    words) gets it by bisection instead, 32 passes over the vocabulary, run only if
    some row needs them. Both find the same cut, but for rounding in the sums of mass."""
    vocab = scaled.shape[-1]
    top_k = _top_k_or_vocab(top_k, vocab)
    shape = (scaled.shape[0], min(window, vocab))
    best, best_ids = largest if largest is not None else branch(  # [B, W], largest first; not needed
        jnp.any(top_k < vocab) | jnp.any(top_p < 1), lambda: tuple(jax.lax.top_k(scaled, shape[1])),  # for min-p
        lambda: (jnp.zeros(shape, scaled.dtype), jnp.zeros(shape, jnp.int32)))
    window = best.shape[-1]
    kth = jnp.where(top_k < vocab, jnp.take_along_axis(best, jnp.minimum(top_k, window)[:, None] - 1, axis=-1)[:, 0],
                    -jnp.inf)
    kth = _or_bisection((top_k > window) & (top_k < vocab), kth, scaled,
                        lambda t: jnp.sum(scaled >= t[:, None], axis=-1) >= top_k)
    ranked = jnp.where(scaled >= kth[:, None], scaled, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)

    nucleus, found = _nucleus(jnp.take_along_axis(probs, best_ids, axis=-1), top_p)
    nucleus = _or_bisection((top_p < 1) & ~found, nucleus, probs,
                            lambda t: jnp.sum(jnp.where(probs >= t[:, None], probs, 0), axis=-1) >= top_p)
    return jnp.where(_keeps(probs, probs.max(axis=-1, keepdims=True), nucleus, top_p, min_p), ranked, -jnp.inf)


def _min_p_filter(scaled, min_p):
    """`_filter` for a batch with no top-k or top-p cut: min-p alone, with no thresholds to find."""
    probs = jax.nn.softmax(scaled, axis=-1)
    best = probs.max(axis=-1, keepdims=True)
    return jnp.where((probs >= min_p[:, None] * best) | (probs == best), scaled, -jnp.inf)


def _nucleus(head, top_p):
    """The top-p cut [B] (a probability) read off each row's largest probabilities head [B, W]
    (largest first), and whether the window holds it [B]. The running mass down the window never
    exceeds the mass at or above that value (tied tokens later in the window or outside it add to
    the latter), and equals it at the end of a run of ties, so the largest value at which it
    reaches top_p is the cut, and it claims no cut that the whole vocabulary would not."""
    reaches = jnp.cumsum(head, axis=-1) >= top_p[:, None]
    return jnp.max(jnp.where(reaches, head, -jnp.inf), axis=-1), reaches.any(axis=-1)


def _keeps(probs, best_prob, nucleus, top_p, min_p):
    """Which of probs [B, N] the top-p cut nucleus [B] and min-p keep; tokens tied with the best
    (best_prob [B, 1]) are always kept."""
    keep = ((top_p[:, None] >= 1) | (probs >= nucleus[:, None])) & (probs >= min_p[:, None] * best_prob)
    return keep | (probs == best_prob)


def _draw_filtered(u, scaled, top_k, top_p, min_p, window: int = SEARCH_WINDOW,
                   top_k_window: int = TOP_K_WINDOW):
    """One draw per row of scaled logits [B, V] after the cuts of `_filter`. A row whose kept
    tokens all lie among its `window` largest draws from those alone; only a batch with some
    other row pays for `_filter` and a draw over the vocabulary. On CPU that saves about ten
    passes over the vocabulary: what remains is the top-k and one pass for the softmax's total.
    A batch in which every row cuts at a top-k below `top_k_window` looks in that smaller window
    first (a row's kept tokens, and so its draw, are the same in both)."""
    vocab = scaled.shape[-1]
    top_k = _top_k_or_vocab(top_k, vocab)

    def in_window(size):
        # The barriers keep XLA from folding later reads of the window into the sort that top-k
        # lowers to, which would stop it from becoming the TopK call again (a full sort, 50x slower).
        # One barrier per output: a barrier over both is folded onto the TopK instruction itself,
        # and XLA:CPU's TopkDecomposer then aborts the process (a check failure in tuple_index)
        # when the sampler is partitioned over a mesh.
        largest = best, best_ids = tuple(map(jax.lax.optimization_barrier, jax.lax.top_k(scaled, min(size, vocab))))
        kept, contained = _window_cuts(scaled, top_k, top_p, min_p, best)
        drawn = categorical(u, jnp.where(kept, best, -jnp.inf))
        return jnp.take_along_axis(best_ids, drawn[:, None], axis=-1)[:, 0], contained, largest

    def search_window():
        tokens, contained, largest = in_window(window)
        return branch(jnp.all(contained), lambda: tokens, lambda: jnp.where(
            contained, tokens, categorical(u, _filter(scaled, top_k, top_p, min_p, largest=largest))))

    if top_k_window >= min(window, vocab):
        return search_window()
    rows = scaled.shape[0]
    tokens, contained = branch(jnp.all(top_k < top_k_window), lambda: in_window(top_k_window)[:2],
                                     lambda: (jnp.zeros(rows, jnp.int32), jnp.zeros(rows, bool)))
    # Rows whose ties run across the small window's edge take the search window's draw; the one
    # search window serves both cases, so it is compiled once.
    return branch(jnp.all(contained), lambda: tokens,
                        lambda: jnp.where(contained, tokens, search_window()))


def _window_cuts(scaled, top_k, top_p, min_p, best):
    """The cuts of `_filter` read on each row's largest logits best [B, W] (largest first; top_k
    with "off" as the vocabulary size): which of them it keeps [B, W], and whether those are all
    it keeps [B]. Only the softmax's total needs the whole row. A row keeps nothing outside its
    window when it drops the window's last token: every token outside is no larger, so a cut (a
    value, a probability, a share of the best probability) that drops the last drops them too."""
    window = best.shape[-1]
    kth = jnp.where((top_k <= window)[:, None],  # [B, 1]; a row whose top-k lies beyond is not contained
                    jnp.take_along_axis(best, jnp.minimum(top_k, window)[:, None] - 1, axis=-1), -jnp.inf)
    total = jnp.sum(jnp.where(scaled >= kth, jnp.exp(scaled - best[:, :1]), 0), axis=-1, keepdims=True)
    probs = jnp.where(best >= kth, jnp.exp(best - best[:, :1]), 0) / total  # [B, W]
    nucleus, found = _nucleus(probs, top_p)
    kept = (best >= kth) & _keeps(probs, probs[:, :1], nucleus, top_p, min_p)
    vocab = scaled.shape[-1]
    contained = ((top_k <= window) | (top_k == vocab)) & ((top_p >= 1) | found) & ~kept[:, -1]
    # A row with no top-k or top-p cut draws over the vocabulary in a batch without cuts, so it
    # does here too: a row's token must not depend on what the others ask.
    return kept, contained & ((top_k < vocab) | (top_p < 1))


def _or_bisection(rows, found, values, holds):
    """`found` [B], with the rows where `rows` is set replaced by `_largest_threshold(values, holds)`
    (computed only if some row is set)."""
    return branch(jnp.any(rows), lambda: jnp.where(rows, _largest_threshold(values, holds), found),
                        lambda: found)


def _largest_threshold(values: jax.Array, holds) -> jax.Array:
    """Per row of float32 values [B, N], the largest float t with holds(t) [B] true, where holds
    is true for small t and turns false once, as t grows: bisection over the 32-bit order of
    float32 values, from the top bit down."""
    def value(key):  # the float32 whose order among all float32s is `key` (uint32)
        sign = jnp.uint32(1 << 31)  # the keys of positive floats have it set; negative ones are flipped
        bits = jnp.where(key >= sign, key ^ sign, ~key)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    def step(i, key):
        trial = key | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(holds(value(trial)), trial, key)
    return value(jax.lax.fori_loop(0, 32, step, jnp.zeros(values.shape[0], jnp.uint32)))


def categorical(u: jax.Array, logits: jax.Array, scale: jax.Array | float = 1.0, chunk: int = 512) -> jax.Array:
    """One draw per row of logits [B, V] from softmax(logits * scale) (scale [B]: an inverse
    temperature, applied inside the one pass over the vocabulary), with one uniform number u [B]
    in [0, 1) per row: the number is placed on the rows' cumulative probability, first among [V/chunk] chunk totals,
    then within the chunk it fell in. jax.random.categorical draws a Gumbel number per vocabulary
    entry instead, which on CPU costs 50x this for a 262k vocabulary (threefry)."""
    b, v = logits.shape
    pad = -v % chunk
    chunks = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, chunk)
    scale = jnp.broadcast_to(jnp.asarray(scale, logits.dtype), (b,))[:, None, None]
    weights = jnp.exp((chunks - chunks.max(axis=(1, 2), keepdims=True)) * scale)  # [B, V/chunk, chunk]
    mass = weights.sum(axis=-1)
    which, offset = _locate(mass, u * mass.sum(axis=-1))  # a point in [0, total) per row
    row = jnp.take_along_axis(weights, which[:, None, None], axis=1)[:, 0]
    within, _ = _locate(row, offset)
    return (which * chunk + within).astype(jnp.int32)


def _locate(weights: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each row of weights [B, N] (>= 0) and a point u [B] in [0, sum): the index i whose
    interval [sum(weights[:i]), sum(weights[:i+1])) holds u, and u's offset into it. Rounding can
    carry u past the last interval; it then falls in the last one of nonzero weight."""
    ends = jnp.cumsum(weights, axis=-1)
    n = weights.shape[-1]
    last = n - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
    i = jnp.minimum(jnp.sum(ends <= u[:, None], axis=-1), last)
    start = jnp.where(i > 0, jnp.take_along_axis(ends, jnp.maximum(i - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    return i, u - start


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sampled tokens' log-probabilities [B] and the top k alternatives
    (ids [B, k], log-probabilities [B, k]) under the model's distribution."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_logp, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_ids.astype(jnp.int32), top_logp
