"""Prefix caching end to end on tiny checkpoints: prompts that share leading pages give Hugging
Face's greedy tokens whether they run together or alone, with caching on or off; cached tokens
are reported; salts separate; an idle engine holds no reference."""

import numpy as np
import pytest
import torch
import transformers

from jaxserve import Engine, EngineConfig, SamplingParams

CONFIG = EngineConfig(max_slots=8, page_size=8, num_pages=96, max_model_len=96, max_num_batched_tokens=64,
                      dtype="float32")
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def shared_prefix_prompts(n=6, prefix_len=21):
    rng = np.random.RandomState(11)
    prefix = rng.randint(3, 150, size=prefix_len).tolist()  # 2 full pages and a bit: chunk edges off pages
    return [prefix + rng.randint(3, 150, size=1 + 3 * i).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def engine(checkpoints, kind):
    return Engine.from_pretrained(checkpoints(kind), CONFIG)


@pytest.fixture(scope="module")
def hf_tokens(checkpoints, kind):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in shared_prefix_prompts()]


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]


def test_shared_prefix_batched_and_alone_match_hugging_face(engine, hf_tokens):
    fresh = engine.with_strategy("paged")  # an empty cache
    together = fresh.generate(shared_prefix_prompts(), PARAMS)
    assert [o.token_ids for o in together] == hf_tokens
    assert together[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 16 for o in together[1:])
    stats = fresh.stats()
    assert stats["prefix_cache_hits"] == 5 * 16 and stats["cached_pages"] > 0
    alone = [fresh.generate([p], PARAMS)[0] for p in shared_prefix_prompts()]  # now every prompt hits
    assert [o.token_ids for o in alone] == hf_tokens and all(o.num_cached_tokens >= 16 for o in alone)
    assert_idle(fresh)


def test_caching_off_gives_the_same_tokens(engine, hf_tokens):
    off = engine.with_strategy("paged", enable_prefix_caching=False)
    outputs = off.generate(shared_prefix_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == hf_tokens
    stats = off.stats()
    assert stats["prefix_cache_hits"] == stats["cached_pages"] == 0 and stats["free_pages"] == stats["total_pages"]


def test_salts_separate_tenants(engine, hf_tokens):
    fresh = engine.with_strategy("paged")
    prompt = shared_prefix_prompts()[2]
    first = fresh.generate([prompt], PARAMS, cache_salt="tenant-a")[0]
    other = fresh.generate([prompt], PARAMS, cache_salt="tenant-b")[0]
    again = fresh.generate([prompt], PARAMS, cache_salt="tenant-a")[0]
    assert first.token_ids == other.token_ids == again.token_ids == hf_tokens[2]
    assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens) == (0, 0, 24)
    with pytest.raises(ValueError, match="cache_salt"):
        fresh.add_request(prompt, PARAMS, cache_salt=5)
    assert_idle(fresh)


def test_preemption_with_shared_pages_keeps_tokens(checkpoints, kind, hf_tokens):
    # 13 pages' worth of KV for 6 prompts: a Gemma 3 page holds one of its 3 layers (3 KV-cache groups).
    small = Engine.from_pretrained(checkpoints(kind), CONFIG.replace(num_pages=14 if kind == "llama" else 40))
    outputs = small.generate(shared_prefix_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == hf_tokens
    assert small.stats()["num_preemptions"] > 0
    assert_idle(small)
