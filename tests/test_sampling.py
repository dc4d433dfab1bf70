"""On-device sampling against plain numpy expectations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker import sampling
from jaxserve.worker.sampling import (MODES, SamplingBatch, _draw_filtered, _filter, _top_k_or_vocab, _window_cuts,
                                      argmax, categorical, row_uniforms, sample, sampling_mode, token_logprobs)


def batch(n, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    full = lambda v, dt: np.full(n, v, dt)
    return SamplingBatch(full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                         full(min_p, np.float32), np.arange(seed, seed + n, dtype=np.uint32))


@pytest.mark.parametrize("vocab", [7, 512, 1000, 4096])
def test_argmax_matches_numpy_including_ties(vocab):
    logits = np.random.RandomState(vocab).randint(0, 5, size=(6, vocab)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(logits))), logits.argmax(-1))


def test_greedy_rows_ignore_seed_and_sampled_rows_follow_it():
    logits = jnp.asarray(np.random.RandomState(0).randn(4, 50).astype(np.float32))
    greedy = sample(logits, batch(4), jnp.arange(4))
    np.testing.assert_array_equal(greedy, np.asarray(logits).argmax(-1))
    a = sample(logits, batch(4, temperature=1.0, seed=7), jnp.full(4, 3))
    b = sample(logits, batch(4, temperature=1.0, seed=7), jnp.full(4, 3))
    np.testing.assert_array_equal(a, b)
    jitted = jax.jit(sample)
    draws = [np.asarray(jitted(logits, batch(4, temperature=1.0, seed=7), jnp.full(4, p))) for p in range(20)]
    assert len({d.tobytes() for d in draws}) > 1  # the key moves with the position


def mixed(rows: list[dict]) -> SamplingBatch:
    """A batch of one row per dict (fields of `batch`, defaults elsewhere); seeds 0, 1, ..."""
    one = [batch(1, **row) for row in rows]
    return SamplingBatch(*(np.concatenate([getattr(b, f) for b in one]) for f in
                           ("temperature", "top_k", "top_p", "min_p")), np.arange(len(rows), dtype=np.uint32))


def test_the_host_picks_the_mode_each_batch_needs():
    assert sampling_mode(mixed([{}, {}]), 50) == "greedy"
    assert sampling_mode(mixed([{"top_p": 0.5}, {}]), 50) == "greedy"  # greedy rows cut nothing
    assert sampling_mode(mixed([{}, {"temperature": 0.7}]), 50) == "random"
    assert sampling_mode(mixed([{"temperature": 0.7, "top_k": 50}]), 50) == "random"  # the whole vocabulary
    for cut in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        assert sampling_mode(mixed([{"temperature": 0.7}, {**cut}]), 50) == "cuts", cut


SAMPLED_ROWS = [{}, {"temperature": 0.7}, {"temperature": 1.3, "top_k": 3}, {"temperature": 1.0, "top_p": 0.6},
                {"temperature": 0.9, "min_p": 0.2}, {"temperature": 1.0, "top_k": 9999}]
BATCHES = [[{}, {}], SAMPLED_ROWS[:2], SAMPLED_ROWS[:3], [{}, SAMPLED_ROWS[4]], SAMPLED_ROWS]


@pytest.mark.parametrize("selects", [False, True], ids=["conditionals", "selects"])
def test_every_mode_and_form_draws_what_the_full_sampler_draws(monkeypatch, selects):
    """A batch's tokens are the same in the mode the host picks for it as in "cuts" (which covers
    every row, run with the CPU's conditionals), and with the accelerators' selects too."""
    logits = jnp.asarray(np.random.RandomState(3).randn(len(SAMPLED_ROWS), 300).astype(np.float32))
    cases = [(mixed(rows), logits[:len(rows)], jnp.arange(len(rows))) for rows in BATCHES]
    expected = [np.asarray(sample(x, params, positions)) for params, x, positions in cases]
    assert {sampling_mode(params, 300) for params, _, _ in cases} == set(MODES)
    monkeypatch.setattr(sampling, "conditionals_skip_work", lambda: not selects)
    for (params, x, positions), tokens in zip(cases, expected):
        np.testing.assert_array_equal(sample(x, params, positions, mode=sampling_mode(params, 300)), tokens)


@pytest.mark.parametrize("selects", [False, True], ids=["conditionals", "selects"])
def test_a_constrained_row_draws_only_allowed_tokens_and_the_others_are_untouched(monkeypatch, selects):
    monkeypatch.setattr(sampling, "conditionals_skip_work", lambda: not selects)
    logits = jnp.asarray(np.random.RandomState(4).randn(3, 70).astype(np.float32))
    params, positions = mixed([{}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}]), jnp.arange(3)
    allowed = np.full((3, 3), -1, np.int32)  # 70 tokens: 3 words of 32 bits
    allowed[0] = allowed[1] = [0, 1 << 1, 0]  # only token 33
    allowed[1, 2] = 1 << 3  # ... or token 67
    free = np.asarray(sample(logits, params, positions))
    for mode in ("cuts", sampling_mode(params, 70)):
        tokens = np.asarray(sample(logits, params, positions, allowed=jnp.asarray(allowed), mode=mode))
        assert tokens[0] == 33 and tokens[1] in (33, 67) and tokens[2] == free[2]
    everything = np.full((3, 3), -1, np.int32)
    np.testing.assert_array_equal(sample(logits, params, positions, allowed=jnp.asarray(everything)), free)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = jnp.asarray(np.random.RandomState(1).randn(8, 300).astype(np.float32))
    expected = np.asarray(logits).argmax(-1)
    for params in (batch(8, temperature=2.0, top_k=1), batch(8, temperature=2.0, top_p=1e-6),
                   batch(8, temperature=2.0, min_p=1.0)):
        np.testing.assert_array_equal(sample(logits, params, jnp.arange(8)), expected)


def test_top_k_restricts_to_the_k_best_and_frequencies_follow_softmax():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    n = 4000
    logits = jnp.asarray(np.tile(row, (n, 1)))
    draws = np.asarray(sample(logits, batch(n, temperature=1.0, top_k=2), jnp.zeros(n, jnp.int32)))
    assert set(draws.tolist()) <= {0, 1}
    assert abs((draws == 0).mean() - 0.5 / 0.8) < 0.03
    draws = np.asarray(sample(logits, batch(n, temperature=1.0), jnp.zeros(n, jnp.int32)))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / n, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    draws = np.asarray(sample(logits, batch(n, temperature=1.0, top_p=0.7), jnp.zeros(n, jnp.int32)))
    assert set(draws.tolist()) <= {0, 1}  # 0.5 < 0.7 needs the second token, not the third
    draws = np.asarray(sample(logits, batch(n, temperature=1.0, min_p=0.5), jnp.zeros(n, jnp.int32)))
    assert set(draws.tolist()) <= {0, 1}  # 0.15 < 0.5 * 0.5


def sorted_filter_reference(row, top_k, top_p, min_p):
    """The token ids that top-k, then top-p, then min-p keep, by sorting the vocabulary."""
    order = np.argsort(-row, kind="stable")
    ranked = np.where((top_k == 0) | (np.arange(len(row)) < top_k), row[order], -np.inf)
    probs = np.exp(ranked - ranked[0])
    probs /= probs.sum()
    keep = (np.cumsum(probs) - probs) < top_p if top_p < 1 else np.ones(len(row), bool)  # 1 is off
    keep &= (probs >= min_p * probs[0]) & np.isfinite(ranked)
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize("window", [8, 256, 1000])  # cuts mostly beyond the window, mixed, all within
@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (50, 0.8, 0.0),
                                               (0, 1.0, 0.05), (40, 0.95, 0.02), (2000, 1.0, 0.0),
                                               (300, 0.9, 0.0)])
def test_threshold_filter_keeps_what_sorting_keeps(top_k, top_p, min_p, window):
    logits = np.random.RandomState(top_k).randn(6, 1000).astype(np.float32) * np.array([[0.5], [1], [2], [2], [4], [8]])
    n = len(logits)
    params = batch(n, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = np.asarray(jax.jit(_filter, static_argnames="window")(
        jnp.asarray(logits, jnp.float32), params.top_k, params.top_p, params.min_p, window=window))
    for row, out in zip(logits, kept):
        assert set(np.flatnonzero(np.isfinite(out)).tolist()) == sorted_filter_reference(row, top_k, top_p, min_p)
        np.testing.assert_array_equal(out[np.isfinite(out)], row[np.isfinite(out)])


@pytest.mark.parametrize("window", [8, 256, 1000])
@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.9, 0.0), (50, 0.8, 0.0), (0, 1.0, 0.05),
                                               (40, 0.95, 0.02), (300, 0.9, 0.0)])
def test_window_holds_all_kept_tokens_exactly_when_sorting_says_so(top_k, top_p, min_p, window):
    """A row with a top-k or top-p cut draws from its window alone only when everything it keeps
    lies there (and not at the window's edge, where tokens outside could tie); it then keeps what
    sorting keeps."""
    logits = np.random.RandomState(top_k).randn(6, 1000).astype(np.float32) * np.array([[0.5], [1], [2], [2], [4], [8]])
    params = batch(6, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    best, ids = jax.lax.top_k(jnp.asarray(logits), window)
    kept, contained = map(np.asarray, jax.jit(_window_cuts)(
        jnp.asarray(logits), _top_k_or_vocab(params.top_k, 1000), params.top_p, params.min_p, best))
    for row, row_ids, row_kept, row_contained in zip(logits, np.asarray(ids), kept, contained):
        expected = sorted_filter_reference(row, top_k, top_p, min_p)
        cut = top_k > 0 or top_p < 1  # a row with min-p alone draws over the vocabulary wherever it is
        assert row_contained == (cut and top_k <= window and expected <= set(row_ids[:-1].tolist()))
        if row_contained:
            assert set(row_ids[row_kept].tolist()) == expected


def test_draws_from_the_window_and_from_the_vocabulary_follow_the_kept_softmax():
    """Rows drawn with many uniform numbers at top-p 0.8: one whose kept tokens lie in a window of 8 (4 of
    them), and again with a window of 2 (drawn over the vocabulary), and in one batch with a row
    that keeps 12 tied tokens, beyond the window of 8."""
    short = np.log(np.array([0.3, 0.25, 0.2, 0.1] + [0.15 / 16] * 16, np.float32))
    flat = np.log(np.array([0.9 / 12] * 12 + [0.1 / 8] * 8, np.float32))
    n = 4000
    u = row_uniforms(jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
    top_k, top_p, min_p = jnp.zeros(n, jnp.int32), jnp.full(n, 0.8), jnp.zeros(n)
    draw = jax.jit(_draw_filtered, static_argnames="window")
    expected_short = np.array([0.3, 0.25, 0.2, 0.1]) / 0.85
    for window in (8, 2):
        draws = np.asarray(draw(u, jnp.asarray(np.tile(short, (n, 1))), top_k, top_p, min_p, window=window))
        np.testing.assert_allclose(np.bincount(draws, minlength=20) / n, np.pad(expected_short, (0, 16)), atol=0.03)
    mixed = np.asarray(draw(u, jnp.asarray(np.tile([short, flat], (n // 2, 1))), top_k, top_p, min_p, window=8))
    np.testing.assert_allclose(np.bincount(mixed[::2], minlength=20) / (n // 2), np.pad(expected_short, (0, 16)),
                               atol=0.03)
    np.testing.assert_allclose(np.bincount(mixed[1::2], minlength=20) / (n // 2), [1 / 12] * 12 + [0] * 8, atol=0.03)


def test_a_row_draws_the_same_token_whatever_the_other_rows_ask():
    """Rows asking for min-p alone, temperature alone, top-p, and top-k (which alone looks in the
    small top-k window first): each draws what it draws alone."""
    logits = jnp.asarray(np.random.RandomState(4).randn(4, 1000).astype(np.float32) * 3)
    params = batch(4, temperature=1.0)
    params.min_p, params.top_p = jnp.array([0.05, 0.0, 0.0, 0.0]), jnp.array([1.0, 1.0, 0.9, 1.0])
    params.top_k = jnp.array([0, 0, 0, 40], jnp.int32)
    jitted = jax.jit(sample)
    for position in range(20):
        together = np.asarray(jitted(logits, params, jnp.full(4, position)))
        for r in range(4):
            alone = jax.tree.map(lambda a: a[r:r + 1], params)
            assert together[r] == np.asarray(jitted(logits[r:r + 1], alone, jnp.full(1, position)))[0]


def test_a_top_k_batch_draws_in_the_small_window_what_it_draws_in_the_search_window():
    """Rows that all cut at a top-k below TOP_K_WINDOW look among their 256 largest logits first,
    and draw the tokens the search window gives them, with top-p and min-p too; a row whose tokens
    tied at its k-th value run past the small window (400 of them) makes the batch fall back."""
    rs = np.random.RandomState(5)
    logits = rs.randn(6, 3000).astype(np.float32) * 3
    logits[5, rs.permutation(3000)[:400]] = 12.0
    top_k = jnp.array([1, 5, 50, 255, 64, 5], jnp.int32)
    top_p, min_p = jnp.array([1.0, 0.9, 0.5, 0.95, 1.0, 1.0]), jnp.array([0.0, 0.0, 0.1, 0.0, 0.0, 0.0])
    draw = jax.jit(_draw_filtered, static_argnames=("window", "top_k_window"))
    ties = set(np.flatnonzero(logits[5] == 12.0).tolist())
    drawn_ties = set()
    for position in range(40):
        u = row_uniforms(jnp.arange(6, dtype=jnp.uint32), jnp.full(6, position))
        for rows in (slice(0, 5), slice(0, 6)):  # without the tied row, then with it
            args = (u[rows], jnp.asarray(logits[rows]), top_k[rows], top_p[rows], min_p[rows])
            small = np.asarray(draw(*args, top_k_window=256))
            np.testing.assert_array_equal(small, np.asarray(draw(*args, top_k_window=10 ** 6)))
        assert small[0] == logits[0].argmax()
        drawn_ties.add(int(small[5]))
    assert drawn_ties <= ties and len(drawn_ties) > 30


def test_window_cuts_keep_tied_tokens_as_bisection_does():
    """Logits on a coarse grid (many ties, some across the window's edge): reading the cuts off the
    window keeps the same tokens as finding them by bisection (a window of one token)."""
    logits = jnp.asarray(np.round(np.random.RandomState(3).randn(8, 1000) * 2).astype(np.float32))
    params = batch(8, temperature=1.0, top_k=0, top_p=0.6)
    params.top_k = jnp.array([0, 0, 3, 20, 0, 7, 0, 100], jnp.int32)
    params.top_p = jnp.array([0.6, 0.3, 1.0, 0.9, 0.05, 0.8, 0.99, 1.0], jnp.float32)
    cut = jax.jit(_filter, static_argnames="window")
    windowed = np.asarray(cut(logits, params.top_k, params.top_p, params.min_p, window=64))
    bisected = np.asarray(cut(logits, params.top_k, params.top_p, params.min_p, window=1))
    np.testing.assert_array_equal(np.isfinite(windowed), np.isfinite(bisected))
    assert (np.isfinite(windowed).sum(-1) < 1000).all()


def test_categorical_follows_softmax_across_chunks():
    """Mass in four chunks of a vocabulary that is not a multiple of the chunk (the last one padded)."""
    vocab, tokens, probs = 1500, [3, 700, 1100, 1499], np.array([0.4, 0.3, 0.2, 0.1])
    row = np.full(vocab, -np.inf, np.float32)
    row[tokens] = np.log(probs)
    n = 8000
    u = row_uniforms(jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
    draws = np.asarray(jax.jit(categorical)(u, jnp.asarray(np.tile(row, (n, 1)))))
    assert set(draws.tolist()) <= set(tokens)
    np.testing.assert_allclose([(draws == t).mean() for t in tokens], probs, atol=0.02)
    hot = np.asarray(categorical(u[:4], jnp.asarray(np.tile(row, (4, 1))), jnp.full(4, 1e6)))
    np.testing.assert_array_equal(hot, [3] * 4)  # a huge inverse temperature is greedy


def test_token_logprobs():
    logits = jnp.asarray(np.random.RandomState(2).randn(3, 20).astype(np.float32))
    tokens = jnp.array([0, 5, 19])
    chosen, top_ids, top_logp = token_logprobs(logits, tokens, 3)
    ref = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(chosen, ref[np.arange(3), [0, 5, 19]], rtol=1e-6)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, -1)[:, :3])
