"""Start-up: after `warmup()` nothing compiles, whatever the request kind or strategy; a second
engine loads every compiled program from the compile cache; a changed config never reuses a
program; a corrupt cache entry is recompiled; a cache over its size loses its least recently used
configurations; a cache folder, or an entry, that another user could have written is never
unpickled; the layer scan matches its unrolled form."""

import copy
import hashlib
import logging
import os
import pickle
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.engine.batching.policies import STRATEGIES
from jaxserve.worker import compile_cache
from jaxserve.worker.compile_cache import ExecutableCache
from jaxserve.model.loader import load_model

CONFIG = EngineConfig(max_slots=8, page_size=8, num_pages=96, max_model_len=64, max_num_batched_tokens=32,
                      dtype="float32")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MIXED = [GREEDY, SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=2, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0.7, min_p=0.1, seed=4, ignore_eos=True)]


def prompts(n=6, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 150, size=int(rng.randint(1, 40))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, monkeypatch_module):
    folder = str(tmp_path_factory.mktemp("jaxserve-cache"))
    monkeypatch_module.setenv("JAXSERVE_CACHE", folder)
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def warm(llama_dir, cache_dir):
    """An engine whose every program was compiled by warmup(), into an empty cache."""
    engine = Engine.from_pretrained(llama_dir, CONFIG)
    assert engine.warmup() == engine.stats()["num_compiles"] == len(engine.runner.all_programs())
    assert engine.runner.cache.loaded == 0
    return engine


def test_nothing_compiles_after_warmup_for_any_request_kind_or_strategy(warm):
    before = warm.stats()["num_compiles"]
    for strategy in STRATEGIES:
        engine = warm.with_strategy(strategy)
        for _ in range(2):  # the repeat hits the prefix cache: other chunk lengths, other buckets
            outputs = engine.generate(prompts() + prompts(2, seed=1), MIXED + MIXED[:2])
            assert all(o.finish_reason == "length" for o in outputs)
            assert outputs[1].logprobs and outputs[4].logprobs
    assert warm.stats()["num_compiles"] == before


def test_a_second_engine_loads_every_program_from_the_cache(warm, llama_dir):
    second = Engine.from_pretrained(llama_dir, CONFIG)
    assert second.warmup() == len(second.runner.all_programs())
    assert second.runner.cache.loaded == len(second.runner.all_programs())  # none compiled
    ours = second.generate(prompts(), MIXED)
    theirs = warm.generate(prompts(), MIXED)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(max_slots=4), dict(page_size=16)])
def test_a_changed_config_reuses_no_program(warm, llama_dir, change):
    other = Engine.from_pretrained(llama_dir, CONFIG.replace(**change))
    assert other.runner.cache.fingerprint != warm.runner.cache.fingerprint
    assert other.runner.cache.load("sample-2-greedy") is None and other.runner.cache.rejected == 0


def test_an_edit_to_any_of_the_engines_sources_reuses_no_program(tmp_path):
    """The programs' key holds a digest of every Python file of the package, its subpackages too
    (the model's files, not only the worker's beside the cache)."""
    import jaxserve
    assert compile_cache.PACKAGE == os.path.dirname(os.path.abspath(jaxserve.__file__))
    package = tmp_path / "jaxserve"
    shutil.copytree(compile_cache.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    before = compile_cache.source_digest.__wrapped__(str(package))
    with open(package / "model" / "layers.py", "a") as f:
        f.write("# an edit\n")
    assert compile_cache.source_digest.__wrapped__(str(package)) != before


def test_a_corrupt_or_truncated_entry_is_logged_and_recompiled(warm, llama_dir, cache_dir, caplog):
    fingerprint = warm.runner.cache.fingerprint
    files = sorted(f for f in os.listdir(os.path.join(cache_dir, "compiled")) if f.startswith(fingerprint))
    forward = next(f for f in files if "-forward-" in f)
    sample = next(f for f in files if "-sample-" in f)
    with open(os.path.join(cache_dir, "compiled", forward), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    with open(os.path.join(cache_dir, "compiled", sample), "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)  # flipped bytes: the checksum no longer matches
    engine = Engine.from_pretrained(llama_dir, CONFIG)
    with caplog.at_level(logging.WARNING, logger="jaxserve.worker.compile_cache"):
        engine.warmup()
    assert engine.runner.cache.rejected == 2
    assert sum("unusable" in r.message for r in caplog.records) == 2
    assert engine.runner.cache.loaded == len(engine.runner.all_programs()) - 2
    assert [o.token_ids for o in engine.generate(prompts(), MIXED)] == \
        [o.token_ids for o in warm.generate(prompts(), MIXED)]
    assert os.path.getsize(os.path.join(cache_dir, "compiled", forward)) > 0  # saved again, whole


def test_a_cache_over_its_size_drops_the_least_recently_used_configurations_never_its_own(warm, cache_dir, tmp_path):
    """Five configurations of 3 programs x 100 bytes: the opener's own, last used at t=5, and four
    others at t=10, 40, 20, 30. A cap of 1000 bytes removes the two oldest others; a cap of 0 every
    other one; the opener's own stays both times."""
    folder = str(tmp_path)
    devices = jax.devices()[:1]
    own = ExecutableCache(folder, "a fifth configuration", devices).fingerprint
    for fingerprint, used in [(own, 5), ("aaa", 10), ("bbb", 40), ("ccc", 20), ("ddd", 30)]:
        for program in ("forward-2", "sample-2", "logprobs-2"):
            path = os.path.join(folder, f"{fingerprint}-{program}.bin")
            with open(path, "wb") as f:
                f.write(b"x" * 100)
            os.utime(path, (used, used))
    with open(os.path.join(folder, "notes.txt"), "w") as f:  # not an entry: never counted or removed
        f.write("y" * 1000)
    cache = ExecutableCache(folder, "a fifth configuration", devices, max_bytes=1000)
    assert cache.fingerprint == own and cache.pruned == ["aaa", "ccc"]
    assert sorted({name.split("-")[0] for name in os.listdir(folder)}) == sorted([own, "bbb", "ddd", "notes.txt"])
    assert ExecutableCache(folder, "a fifth configuration", devices, max_bytes=0).pruned == ["ddd", "bbb"]
    assert sorted({name.split("-")[0] for name in os.listdir(folder)}) == sorted([own, "notes.txt"])

    # A load marks its entry used: the older configuration, just loaded from, outlives a newer one.
    folder = str(tmp_path / "used")
    os.makedirs(folder)
    real = os.path.join(cache_dir, "compiled", f"{warm.runner.cache.fingerprint}-sample-2-greedy.bin")
    for name, used in [(os.path.basename(real), 10), ("zzz-sample-2-greedy.bin", 20)]:
        shutil.copyfile(real, os.path.join(folder, name))
        os.chmod(os.path.join(folder, name), 0o600)  # whatever the umask: an entry only we may write
        os.utime(os.path.join(folder, name), (used, used))
    reader = copy.copy(warm.runner.cache)
    reader.folder = folder
    assert reader.load("sample-2-greedy") is not None
    cache = ExecutableCache(folder, "a third configuration", jax.devices()[:1], max_bytes=os.path.getsize(real))
    assert cache.pruned == ["zzz"] and os.listdir(folder) == [os.path.basename(real)]


def test_a_cache_folder_others_may_write_is_refused_before_anything_is_unpickled(tmp_path, monkeypatch):
    devices = jax.devices()[:1]
    ExecutableCache(str(tmp_path / "not yet made"), "a configuration", devices)  # made 0700 at the first save
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o755)
    ExecutableCache(str(folder), "a configuration", devices)
    for mode in (0o777, 0o775, 0o757):
        os.chmod(folder, mode)
        with pytest.raises(ValueError, match=f"{folder} may be written by other users .mode {mode:o}.*"
                                             f"`chmod go-w {folder}`.*JAXSERVE_CACHE"):
            ExecutableCache(str(folder), "a configuration", devices)
    os.chmod(folder, 0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(folder).st_uid + 1)  # the folder is another user's
    with pytest.raises(ValueError, match=f"{folder} is owned by another user .uid {os.stat(folder).st_uid}.*chown"):
        ExecutableCache(str(folder), "a configuration", devices)


def test_an_engine_refuses_to_start_on_a_compile_cache_others_may_write(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    os.mkdir(tmp_path / "compiled")
    os.chmod(tmp_path / "compiled", 0o777)
    with pytest.raises(ValueError, match="compile cache folder .*compiled may be written by other users"):
        Engine.from_pretrained(llama_dir, CONFIG)


def test_an_entry_others_may_have_written_is_never_unpickled(tmp_path, monkeypatch, caplog):
    """In a private folder, an entry with a valid checksum is unpickled only when this user alone
    could have written it: a file writable by others, or another user's, is logged and removed."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    cache = ExecutableCache(str(folder), "a configuration", jax.devices()[:1])
    unpickled = []
    monkeypatch.setattr(compile_cache, "pickle", SimpleNamespace(loads=unpickled.append))
    payload = pickle.dumps("not a program")
    uid = os.stat(folder).st_uid

    def entry(mode: int) -> str:
        path = cache._path("sample-2-greedy")
        with open(path, "wb") as f:
            f.write(hashlib.sha256(payload).digest() + payload)
        os.chmod(path, mode)
        return path
    with caplog.at_level(logging.WARNING, logger="jaxserve.worker.compile_cache"):
        for mode in (0o666, 0o620, 0o602):
            path = entry(mode)
            assert cache.load("sample-2-greedy") is None and not os.path.exists(path)
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
        path = entry(0o600)
        assert cache.load("sample-2-greedy") is None and not os.path.exists(path)
        assert unpickled == [] and cache.rejected == 4
        assert sum("so it is not unpickled" in r.message for r in caplog.records) == 4
        monkeypatch.setattr(os, "geteuid", lambda: uid)
        entry(0o600)
        cache.load("sample-2-greedy")  # ours alone: unpickled (then refused: not a program)
    assert unpickled == [payload] and cache.rejected == 5


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_the_layer_scan_matches_the_unrolled_layers(checkpoints, kind):
    """The scanned step's logits against the same layers run one by one in Python (float32)."""
    from flax import nnx

    from model_helpers import paged_logits
    from jaxserve.model import transformer
    cfg, weights, _, _ = load_model(checkpoints(kind), "float32")
    model = transformer.Transformer(cfg, weights)
    tokens = np.random.RandomState(3).randint(3, 150, size=21)
    scanned = paged_logits(model, tokens, prompt_len=13, chunk=5)

    def unrolled_scan(f, init, xs, **_):
        carry, n = init, jax.tree.leaves(xs)[0].shape[0]
        for i in range(n):
            carry, _ = f(carry, jax.tree.map(lambda x: jax.numpy.asarray(x)[i], xs))
        return carry, None
    original = jax.lax.scan
    jax.clear_caches()  # the helper's jitted forward must trace again, through the loop below
    try:
        jax.lax.scan = unrolled_scan
        unrolled = paged_logits(transformer.Transformer(cfg, weights), tokens, prompt_len=13, chunk=5)
    finally:
        jax.lax.scan = original
        jax.clear_caches()
    np.testing.assert_allclose(scanned, unrolled, atol=1e-4, rtol=1e-4)
    assert nnx.state(model)["layers"]["attn"]["qkv"][...].shape[0] == cfg.num_layers  # stacked
