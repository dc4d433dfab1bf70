"""The hybrid KV allocator end to end, on tiny Gemma 3, Gemma 2 and Mistral checkpoints whose
sliding window (16 tokens) is a fraction of their prompts (4-10x): Hugging Face's greedy tokens
with prefix caching on and off, at token budgets of 8, 16 and 64, with steps overlapped, and under
preemption; the sliding groups hold only their window; no page is leaked and nothing compiles
after warm-up."""

import numpy as np
import pytest
import torch
import transformers
from conftest import build_checkpoint

from jaxserve import Engine, EngineConfig, SamplingParams

WINDOW = 16
CONFIG = EngineConfig(max_slots=4, page_size=8, num_pages=160, max_model_len=192, max_num_batched_tokens=64,
                      dtype="float32")
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def hybrid_prompts():
    """6 prompts of 64-160 tokens; pairs share a leading 40 (5 full pages, past the window)."""
    rng = np.random.RandomState(5)
    prefix = rng.randint(3, 150, size=40).tolist()
    lengths = [64, 100, 160, 72, 130, 90]
    return [(prefix if i % 2 else []) + rng.randint(3, 150, size=n - (40 if i % 2 else 0)).tolist()
            for i, n in enumerate(lengths)]


GROUPS = {"gemma3": (None, WINDOW, WINDOW),  # 2 local layers, 1 global: a layer per page
          "gemma2": (None, WINDOW),  # 2 and 2: two layers per page
          "mistral": (WINDOW,)}  # every layer local: one group


@pytest.fixture(scope="module", params=sorted(GROUPS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def path(tmp_path_factory, kind):
    return build_checkpoint(str(tmp_path_factory.mktemp(f"{kind}_window16")), kind, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def engine(path):
    engine = Engine.from_pretrained(path, CONFIG)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def hf_tokens(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in hybrid_prompts()]


def assert_idle(engine):
    stats, blocks = engine.stats(), engine.blocks
    assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]
    assert all(blocks.group_pages(g)[0] == 0 for g in range(blocks.num_groups)), "a group holds used pages"


def test_layers_form_the_expected_groups(engine, kind):
    assert engine.runner.kv_groups.windows == GROUPS[kind]


@pytest.mark.parametrize("budget", [8, 16, 64])
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_greedy_tokens_match_hugging_face(engine, hf_tokens, budget, caching):
    compiles = engine.runner.num_compiles
    run = engine.with_strategy("paged", max_num_batched_tokens=budget, enable_prefix_caching=caching)
    outputs = run.generate(hybrid_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == hf_tokens
    if caching:
        assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_idle(run)
    assert engine.runner.num_compiles == compiles  # every shape was compiled at warm-up


def test_overlapped_steps_and_a_warm_cache_give_the_same_tokens(engine, hf_tokens):
    run = engine.with_strategy("paged", max_num_batched_tokens=16, async_scheduling=True)
    run.generate(hybrid_prompts(), PARAMS)
    again = run.generate(hybrid_prompts(), PARAMS)  # hits now reach into the sliding groups' windows
    assert [o.token_ids for o in again] == hf_tokens
    # The 160-token prompt hits its 19 full pages (the pool does not keep every page of the first
    # run: the LRU evicted some of the others'): far past the window in every group.
    assert max(o.num_cached_tokens for o in again) == 152
    assert_idle(run)


def test_a_sliding_group_holds_only_its_window(engine):
    run = engine.with_strategy("paged", max_num_batched_tokens=16, enable_prefix_caching=False)
    prompt = hybrid_prompts()[2]  # 160 tokens: 20 pages
    run.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    windows = run.runner.kv_groups.windows
    most = [0] * len(windows)
    while run.has_unfinished():
        run.step()
        for g in range(len(windows)):
            most[g] = max(most[g], run.blocks.group_pages(g)[0])
    for window, pages in zip(windows, most):
        if window is None:
            assert pages == 23  # 180 tokens
        else:  # the window's pages, the step's 16 tokens and a partial page at each end
            assert pages <= -(-(WINDOW + 16) // 8) + 2
    assert_idle(run)


def test_preemption_gives_the_same_tokens(path, kind, hf_tokens):
    # Room for one sequence of max_model_len (24 pages in a full group, 5 in a sliding one), not 4.
    pages = {"gemma3": 40, "gemma2": 32, "mistral": 12}[kind]
    small = Engine.from_pretrained(path, CONFIG.replace(num_pages=pages, max_num_batched_tokens=16))
    outputs = small.generate(hybrid_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == hf_tokens
    assert small.stats()["num_preemptions"] > 0
    assert_idle(small)


def test_stats_state_and_metrics_count_pages_per_group(engine):
    from jaxserve.engine.state import engine_state
    from jaxserve.entrypoints.metrics import Metrics
    from jaxserve.entrypoints.openapi import EngineState
    run = engine.with_strategy("paged", max_num_batched_tokens=16)
    request_id = run.add_request(hybrid_prompts()[2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for _ in range(12):  # mid-prefill, past the window
        run.step()
    stats = run.stats()
    groups = stats["kv_groups"]
    assert [g["window"] for g in groups] == list(run.runner.kv_groups.windows)
    assert sum(g["used_pages"] for g in groups) == stats["used_pages"] > 0
    assert sum(g["cached_pages"] for g in groups) == stats["cached_pages"]
    state = engine_state(run)
    EngineState.model_validate(state)
    assert state["pages"]["groups"] == [{"window": g["window"], "used": g["used_pages"], "cached": g["cached_pages"]}
                                        for g in groups]
    metrics = Metrics()
    metrics.observe_engine(stats)
    text = metrics.render().decode()
    for i, g in enumerate(groups):
        window = "full" if g["window"] is None else str(g["window"])
        assert f'jaxserve_kv_group_pages{{group="{i}",state="used",window="{window}"}} {float(g["used_pages"])}' \
            in text
    run.abort(request_id)
    assert_idle(run)
