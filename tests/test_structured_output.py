"""Structured output: the spec's checks, the host's token masks against bits computed by hand,
a sampler that never draws a forbidden token, and the engine end to end on a tiny Llama whose
tokenizer spells JSON: outputs the grammar forces exactly, mixed batches, abort, preemption in
the middle of an output, prefix caching, bad schemas, and no compile after warm-up."""

from __future__ import annotations

import collections
import json
import re
import threading

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams, StructuredOutputs
from jaxserve.engine.batching.structured_outputs import closed_objects
from jaxserve.worker.sampling import SamplingBatch, sample
from jaxserve.engine import grammars
from jaxserve.engine.grammars import GrammarMatchers
from jaxserve.faults import faults
from jaxserve.tokenizer import Tokenizer

# 39 pages of 8 tokens: six requests of ~70 tokens preempt each other, one alone never is.
CONFIG = EngineConfig(max_slots=8, page_size=8, num_pages=40, max_model_len=96, max_num_batched_tokens=32,
                      dtype="float32")
PROMPT = "the quick brown fox"
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["fox", "dog"]}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def constrained(max_tokens=24, temperature=0.0, seed=None, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputs(**spec))


@pytest.fixture(scope="module")
def engine(symbols_llama_dir):
    """Warmed up: every test here must run without compiling."""
    engine = Engine.from_pretrained(symbols_llama_dir, CONFIG)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def tokenizer(symbols_llama_dir):
    return Tokenizer.from_dir(symbols_llama_dir)


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["used_pages"] == 0
    assert len(engine.core.grammars) == engine.core.grammars.num_compiling == 0, "a grammar outlived its request"
    assert not engine.core.compiling


# ---- the spec ----

@pytest.mark.parametrize("spec, message", [
    (dict(), "structured_outputs must set exactly one of"),
    (dict(regex="a", choice=["b"]), "got regex, choice"),
    (dict(json="{nope"), "structured_outputs.json is not valid JSON"),
    (dict(json={"type": "objekt"}), "structured_outputs.json is invalid"),
    (dict(regex="(a"), "structured_outputs.regex is invalid"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(grammar="start: missing_rule"), "structured_outputs.grammar is invalid"),
    (dict(grammar='root ::= "a" | other'), "structured_outputs.grammar is invalid"),
    (dict(json={"type": "objekt"}, name="response_format.json_schema.schema"),
     "response_format.json_schema.schema is invalid"),
])
def test_a_bad_spec_is_a_value_error_naming_the_field(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputs(**spec)


def test_specs_compile_and_travel():
    import pickle
    for spec in (dict(json=SCHEMA), dict(json=json.dumps(SCHEMA)), dict(json_object=True), dict(regex="[a-z]+"),
                 dict(choice=["yes", "no"]), dict(grammar='start: "a" | "b"'), dict(grammar='root ::= "a" | "b"')):
        params = SamplingParams(structured_outputs=StructuredOutputs(**spec))
        again = pickle.loads(pickle.dumps(params))  # to the engine process
        assert again == params and hash(again) == hash(params)
        assert again.structured_outputs.llguidance_grammar == params.structured_outputs.llguidance_grammar
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    # Properties are generated in the schema's order, so the spec keeps it.
    spec = StructuredOutputs(json={"type": "object", "properties": {"zeta": {}, "alpha": {}}})
    assert spec.json.index("zeta") < spec.json.index("alpha")


# ---- host masks ----

def bits(tokens, vocab) -> np.ndarray:
    """The int32 bitmask [ceil(vocab / 32)] with exactly `tokens` set."""
    words = np.zeros(-(-vocab // 32), np.uint32)
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def pieces(tokenizer) -> dict[int, str]:
    """Each ordinary token's text."""
    vocab = tokenizer._tok.get_vocab()
    return {i: t.replace("\u2581", " ") for t, i in vocab.items() if not (t.startswith("<") and t.endswith(">"))}


def test_masks_hold_exactly_the_tokens_that_continue_the_grammar(tokenizer):
    vocab, eos = 160, 2
    matchers = GrammarMatchers(tokenizer, vocab, (eos,))
    matchers.add("a", StructuredOutputs(choice=["yes", "no"]))
    matchers.add("b", StructuredOutputs(regex="x+"))
    mask, failed = matchers.fill([("a", 1, ()), ("b", 3, ())], 4)
    assert mask.shape == (4, 5) and mask.dtype == np.int32 and failed == []
    assert (mask[0] == -1).all() and (mask[2] == -1).all()  # unconstrained rows allow everything
    text = pieces(tokenizer)
    assert (mask[1] == bits([i for i, p in text.items() if "yes".startswith(p) or "no".startswith(p)], vocab)).all()
    assert (mask[3] == bits([i for i, p in text.items() if p and set(p) == {"x"}], vocab)).all()
    # After "x" the regex may end: EOS joins the x tokens. After "yes" nothing may follow.
    assert matchers.consume("b", tokenizer.encode("x", add_special_tokens=False)[0]) and not matchers.done("b")
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert matchers.consume("a", token)
    assert matchers.done("a")
    mask, _ = matchers.fill([("b", 0, ())], 1)
    assert (mask[0] == bits([i for i, p in text.items() if p and set(p) == {"x"}] + [eos], vocab)).all()
    assert matchers.fill_steps == 2 and matchers.fill_seconds > 0
    matchers.remove("a")
    assert "a" not in matchers and len(matchers) == 1


def test_llguidance_tokenizer_is_built_once_per_tokenizer_and_needs_one(tokenizer):
    first = GrammarMatchers(tokenizer, 160, (2,))
    first.prepare()  # in a thread of its own
    first.add("ok", StructuredOutputs(regex="[a-z]+"))
    assert GrammarMatchers(tokenizer, 160, (2,))._ll_tokenizer is first._ll_tokenizer  # another engine's
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        GrammarMatchers(None, 160).add("x", StructuredOutputs(regex="a"))


def test_objects_that_list_their_properties_are_closed():
    inner = {"type": "object", "properties": {"z": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"properties": inner, "open": {**inner, "additionalProperties": True}},
              "anyOf": [{"properties": {"k": {"const": {"properties": {}}}}}],
              "allOf": [{"properties": {"b": inner}}], "$defs": {"d": inner}, "enum": [{"properties": {}}]}
    closed_inner = {**inner, "additionalProperties": False}
    assert closed_objects(schema) == {
        "type": "object", "properties": {"properties": closed_inner, "open": {**inner, "additionalProperties": True}},
        "anyOf": [{"properties": {"k": {"const": {"properties": {}}}}, "additionalProperties": False}],
        "allOf": [{"properties": {"b": closed_inner}}],  # a branch of allOf stays open, as does its parent
        "$defs": {"d": closed_inner}, "enum": [{"properties": {}}]}
    assert closed_objects({"$ref": "#/$defs/d", "properties": {}}) == {"$ref": "#/$defs/d", "properties": {}}


def test_a_schema_without_additional_properties_allows_none(tokenizer):
    vocab = 160
    matchers = GrammarMatchers(tokenizer, vocab, (2,))
    matchers.add("a", StructuredOutputs(json={"type": "object", "properties": {"a": {"enum": [1]}}}))
    for token in tokenizer.encode('{"a": 1', add_special_tokens=False):
        assert matchers.consume("a", token)
    mask, _ = matchers.fill([("a", 0, ())], 1)  # the object can only end: no ", " for a property of the model's own
    assert (mask[0] == bits([i for i, p in pieces(tokenizer).items() if p == "}"], vocab)).all()


# ---- the sampler ----

MODES = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.3), dict(temperature=2.0, top_k=3),
         dict(temperature=1.0, top_k=300), dict(temperature=1.0, top_p=0.5), dict(temperature=1.5, min_p=0.2),
         dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("mode", MODES, ids=[",".join(f"{k}={v}" for k, v in m.items()) for m in MODES])
def test_the_sampler_never_draws_a_forbidden_token(mode):
    rows, vocab = 8, 1000
    rng = np.random.RandomState(0)
    logits = rng.randn(rows, vocab).astype(np.float32) * 3
    allowed = [rng.choice(vocab, size=n, replace=False) for n in (1, 2, 5, 50, 400, vocab, 3, 7)]
    # Forbid each row's best tokens, so a mask the sampler ignored would show at once.
    allowed[1] = np.argsort(logits[1])[:2]
    mask = np.stack([bits(a, vocab) for a in allowed])
    params = SamplingBatch(np.full(rows, mode.get("temperature", 1.0), np.float32),
                           np.full(rows, mode.get("top_k", 0), np.int32), np.full(rows, mode.get("top_p", 1.0), np.float32),
                           np.full(rows, mode.get("min_p", 0.0), np.float32), np.arange(rows, dtype=np.uint32))
    draw = jax.jit(sample)
    seen = [set() for _ in range(rows)]
    for position in range(40):
        tokens = np.asarray(draw(jnp.asarray(logits), params, jnp.full(rows, position, jnp.int32), jnp.asarray(mask)))
        for r, t in enumerate(tokens):
            assert t in allowed[r], f"row {r} drew forbidden token {t}"
            seen[r].add(int(t))
    if mode["temperature"] == 0:  # greedy takes the best allowed token
        assert all(s == {int(a[np.argmax(logits[r, a])])} for r, (s, a) in enumerate(zip(seen, allowed)))
    unmasked = np.asarray(draw(jnp.asarray(logits), params, jnp.zeros(rows, jnp.int32),
                               jnp.full(mask.shape, -1, jnp.int32)))
    assert (unmasked == np.asarray(draw(jnp.asarray(logits), params, jnp.zeros(rows, jnp.int32)))).all()


# ---- the engine ----

def test_the_grammar_forces_exact_outputs(engine):
    outs = engine.generate([PROMPT] * 4, [
        constrained(choice=["the lazy dog"]),
        constrained(regex=r"jumps over \[1, 2\]", temperature=1.0, seed=3),
        constrained(choice=["yes"], temperature=0.7, seed=1),
        constrained(grammar='start: "null" | "[" "true" "]"', max_tokens=2)])
    assert [o.text for o in outs[:3]] == ["the lazy dog", "jumps over [1, 2]", "yes"]
    assert [o.finish_reason for o in outs[:3]] == ["stop"] * 3
    assert outs[3].text in ("null", "[true]") or outs[3].finish_reason == "length"
    assert_idle(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_outputs_validate(engine, temperature):
    outs = engine.generate([PROMPT, "a", "[1"], [constrained(json=SCHEMA, max_tokens=40, temperature=temperature,
                                                             seed=s) for s in range(3)])
    for o in outs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), SCHEMA)
    any_object = engine.generate(PROMPT, constrained(json_object=True, max_tokens=40, temperature=1.0, seed=5))[0]
    assert any_object.text.lstrip().startswith("{")
    if any_object.finish_reason == "stop":
        assert isinstance(json.loads(any_object.text), dict)
    assert_idle(engine)


def test_mixed_batches_change_no_ones_tokens(engine):
    free = SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    json_params = constrained(json=SCHEMA, max_tokens=30, temperature=0.9, seed=7)
    regex_params = constrained(regex="[a-z ]{3,12}", temperature=0.9, seed=8)
    together = engine.generate([PROMPT, "a dog", PROMPT, "yes"], [free, json_params, regex_params, free])
    alone = [engine.generate(p, params)[0] for p, params in
             zip([PROMPT, "a dog", PROMPT, "yes"], [free, json_params, regex_params, free])]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert re.fullmatch("[a-z ]{3,12}", together[2].text)
    assert_idle(engine)


def test_abort_frees_the_matcher(engine):
    rid = engine.add_request(PROMPT, constrained(regex="[a-z]{30}", max_tokens=60, temperature=1.0, seed=2))
    for _ in range(3):
        engine.step()
    assert rid in engine.core.grammars
    engine.abort(rid)
    assert rid not in engine.core.grammars and engine.output(rid).finish_reason == "abort"
    engine.release(rid)
    assert_idle(engine)


GATED = "[a-z]{7}"  # a grammar whose compile waits for the test (`gate`)
UNGATED = "[a-z]{7,7}"  # the same language, compiled at once


@pytest.fixture
def gate(engine, monkeypatch):
    """Compiles of the regex GATED wait until `gate.set()`, then raise `gate.error` if set."""
    gate = threading.Event()
    gate.error = None
    compile_now = engine.core.grammars._compile

    def gated(spec):
        if spec.regex == GATED:
            gate.wait(30)
            if gate.error is not None:
                raise gate.error
        return compile_now(spec)
    monkeypatch.setattr(engine.core.grammars, "_compile", gated)
    monkeypatch.setattr(engine.core.grammars, "_grammars", collections.OrderedDict())  # none kept: each compiles
    yield gate
    gate.set()  # a compile nobody waits for any more ends


def test_a_grammar_asked_for_again_is_copied_not_compiled(engine, monkeypatch):
    compiles = []
    compile_now = engine.core.grammars._compile
    monkeypatch.setattr(engine.core.grammars, "_compile", lambda spec: compiles.append(spec) or compile_now(spec))
    params = constrained(regex="[a-z]{3} [0-9]{2}", max_tokens=12)
    first = engine.generate([PROMPT, "a dog"], params)
    again = engine.generate([PROMPT, "a dog", PROMPT], params)
    assert len(compiles) == 1
    assert [o.token_ids for o in again] == [o.token_ids for o in first] + [first[0].token_ids]
    assert all(re.fullmatch("[a-z]{3} [0-9]{2}", o.text) for o in again)
    assert_idle(engine)


def test_a_grammar_compiles_beside_the_loop_while_the_others_step(engine, gate):
    slow, plain = constrained(regex=GATED), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference = engine.generate([PROMPT, "a dog"], [constrained(regex=UNGATED), plain])
    engine.add_request(PROMPT, slow, request_id="slow")
    engine.add_request("a dog", plain, request_id="plain")
    engine.run_until(lambda: engine.request("plain").finished)
    assert engine.output("plain").token_ids == reference[1].token_ids
    assert "slow" in engine.core.compiling and engine.stats()["waiting"] == 1 and engine.has_unfinished()
    gate.set()
    engine.run_until(lambda: engine.request("slow").finished)
    out = engine.output("slow")
    assert (out.token_ids, out.finish_reason) == (reference[0].token_ids, reference[0].finish_reason)
    for request_id in ("slow", "plain"):
        engine.release(request_id)
    assert_idle(engine)


@pytest.mark.parametrize("how", ["fails", "too slow"])
def test_a_grammar_that_fails_or_compiles_too_long_ends_alone_with_error(engine, gate, monkeypatch, how):
    monkeypatch.setattr(grammars, "COMPILE_LIMIT_S", 0.2)
    others = [constrained(regex="[a-z ]{3,12}"), SamplingParams(max_tokens=10, temperature=0.9, seed=11)]
    reference = engine.generate([PROMPT, "yes"], others)
    if how == "fails":
        gate.error = ValueError("structured_outputs.regex is invalid: injected")
        gate.set()
    ids = [engine.add_request(p, q, request_id=f"r{i}") for i, (p, q) in enumerate(zip([PROMPT, "yes"], others))]
    engine.add_request(PROMPT, constrained(regex=GATED), request_id="bad")
    engine.run_until(lambda: all(engine.request(i).finished for i in ids + ["bad"]))
    bad = engine.output("bad")
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error == ("structured_outputs.regex is invalid: injected" if how == "fails" else
                         "its grammar took longer than 0.2 s to compile")
    assert [engine.output(i).token_ids for i in ids] == [o.token_ids for o in reference]
    for request_id in ids + ["bad"]:
        engine.release(request_id)
    assert_idle(engine)


def test_a_grammar_whose_parser_refuses_the_first_token_ends_alone_saying_why(engine):
    """600 optional properties in a fixed order compile, but llguidance's parser refuses the first
    token ("{"): the row it opens holds 2399 items, over its limit of 2000. That request ends with
    `error` and llguidance's reason; the requests beside it keep a run's tokens without it."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    others = [constrained(regex="[a-z ]{3,12}"), SamplingParams(max_tokens=10, temperature=0.9, seed=11)]
    reference = engine.generate([PROMPT, "yes"], others)
    ids = [engine.add_request(p, q, request_id=f"r{i}") for i, (p, q) in enumerate(zip([PROMPT, "yes"], others))]
    engine.add_request(PROMPT, constrained(json=schema), request_id="bad")
    engine.run_until(lambda: all(engine.request(i).finished for i in ids + ["bad"]))
    bad = engine.output("bad")
    assert bad.finish_reason == "error"
    assert bad.error.startswith("its grammar refused the next token: Parser Error: Current row has 2399 items; "
                                "max is 2000"), bad.error
    assert [engine.output(i).token_ids for i in ids] == [o.token_ids for o in reference]
    for request_id in ids + ["bad"]:
        engine.release(request_id)
    assert_idle(engine)


def test_an_abort_while_the_grammar_compiles_ends_the_request(engine, gate):
    engine.add_request(PROMPT, constrained(regex=GATED), request_id="waits")
    engine.step()
    engine.abort("waits")
    assert engine.output("waits").finish_reason == "abort" and not engine.has_unfinished()
    engine.release("waits")
    assert_idle(engine)


def test_preemption_mid_output_resumes_with_the_grammar_intact(engine, monkeypatch):
    prompts = [f"{PROMPT} {i} " * 3 for i in range(6)]
    pattern = r"\[(true|false|null|[0-9]+)(, (true|false|null|[0-9]+)){10,16}\]"  # long: they must meet
    params = [constrained(regex=pattern, max_tokens=40, temperature=1.0, seed=i) for i in range(6)]
    alone = [engine.generate(p, q)[0] for p, q in zip(prompts, params)]
    preempted_at = []  # output tokens each preempted request held
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt",
                        lambda r: (preempted_at.append(len(r.output_token_ids)), preempt(r)))
    together = engine.generate(prompts, params)
    assert any(n > 0 for n in preempted_at), preempted_at  # in the middle of a constrained output
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for o in together:
        assert o.finish_reason == "length" or re.fullmatch(pattern, o.text), o.text
    assert_idle(engine)


@pytest.fixture
def fault():
    """`faults.arm(point, request_id)`, disarmed after the test."""
    yield faults.arm
    faults.clear()


def test_a_mask_that_fails_is_found_row_by_row(tokenizer, fault):
    matchers = GrammarMatchers(tokenizer, 160, (2,))
    matchers.add("a", StructuredOutputs(choice=["yes", "no"]))
    matchers.add("b", StructuredOutputs(regex="x+"))
    whole, _ = matchers.fill([("a", 0, ()), ("b", 2, ())], 3)
    fault("grammar_mask", "a")
    mask, failed = matchers.fill([("a", 0, ()), ("b", 2, ())], 3)
    assert failed == ["a"] and (mask[0] == -1).all() and (mask[1:] == whole[1:]).all()


def test_a_request_whose_mask_fails_ends_alone_with_error(engine, fault):
    """Its grammar's mask raises when its first token is to be sampled: it ends with `error`
    before that step runs; the constrained and plain requests beside it keep a fault-free run's
    tokens; no page or matcher is left."""
    prompts = [PROMPT, "a dog", PROMPT, "yes"]
    params = [constrained(json=SCHEMA, max_tokens=30, temperature=0.9, seed=7), constrained(regex="[a-z ]{3,12}"),
              constrained(choice=["the lazy dog"]), SamplingParams(max_tokens=10, temperature=0.9, seed=11)]
    reference = engine.generate(prompts, params)
    fault("grammar_mask", "bad")
    ids = [engine.add_request(p, q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]
    engine.add_request(PROMPT, constrained(regex="[a-z]{20}"), request_id="bad")
    engine.run_until(lambda: all(engine.request(i).finished for i in ids + ["bad"]))
    bad = engine.output("bad")
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error == "its grammar's token mask could not be computed"
    assert [engine.output(i).token_ids for i in ids] == [o.token_ids for o in reference]
    for i in ids + ["bad"]:
        engine.release(i)
    assert engine.stats()["num_errors"] == 0
    assert_idle(engine)


def test_prefix_cache_hits_keep_constrained_outputs(engine):
    prompt = PROMPT + " jumps over the lazy dog. " * 3
    params = constrained(json=SCHEMA, max_tokens=30, temperature=0.8, seed=4)
    first = engine.generate(prompt, params)[0]
    second = engine.generate(prompt, params)[0]
    assert second.num_cached_tokens > 0 and second.token_ids == first.token_ids
    jsonschema.validate(json.loads(second.text), SCHEMA)
    assert_idle(engine)


def test_bad_specs_queue_nothing(engine):
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        engine.add_request(PROMPT, constrained(regex="(unclosed"))
    no_tokenizer = Engine(engine.model_config, None, None, CONFIG, runner=engine.runner)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        no_tokenizer.add_request([5, 6, 7], constrained(regex="a"))
    with pytest.raises(ValueError, match="needs a tokenizer"):  # a payload is queued whole or not at all
        no_tokenizer.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2), constrained(regex="a")])
    assert no_tokenizer.stats()["waiting"] == 0 and not no_tokenizer._requests
    assert_idle(engine)


def test_constrained_and_plain_requests_mixed_compile_nothing_after_warmup(engine):
    before = engine.stats()["num_compiles"]
    assert before == len(engine.runner.all_programs())
    for strategy in ("paged", "continuous", "dynamic"):
        other = engine.with_strategy(strategy)
        outs = other.generate([PROMPT, "a", PROMPT * 2, "[1, 2"], [
            SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True),
            constrained(json=SCHEMA, max_tokens=30, temperature=0.8, seed=1),
            constrained(choice=["yes", "no"], temperature=0),
            SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=2, ignore_eos=True)])
        assert outs[2].text in ("yes", "no")
        stats = other.stats()
        assert stats["structured_output_mask_steps"] > 0 and stats["structured_output_mask_seconds"] > 0
    assert engine.stats()["num_compiles"] == before


# ---- over HTTP (last: the engine's loop moves to a thread) ----

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": PROMPT}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["paris", "oslo"]}}, "required": ["city"],
                                                "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


@pytest.fixture(scope="module")
def server(engine):
    from jaxserve.entrypoints.engine_client import EngineClient
    from jaxserve.entrypoints.api_server import create_app
    from server_helpers import ServerThread
    client = EngineClient.in_thread(engine)
    with ServerThread(create_app(client)) as s:
        yield s
    client.stop()


def post(server, path, body):
    import httpx
    return httpx.post(server.url + path, json=body, timeout=60)


def openai_client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model_name(server) -> str:
    import httpx
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_openai_client_parses_a_pydantic_response_format(server):
    from typing import Literal

    import pydantic

    class Animal(pydantic.BaseModel):
        name: Literal["fox", "dog"]
        ok: bool
    completions = openai_client(server).chat.completions
    parse = getattr(completions, "parse", None) or openai_client(server).beta.chat.completions.parse
    for temperature in (0.0, 1.0):
        completion = parse(model=model_name(server), messages=MESSAGES, response_format=Animal, max_tokens=40,
                           temperature=temperature, seed=3)
        assert isinstance(completion.choices[0].message.parsed, Animal)
        assert completion.choices[0].finish_reason == "stop"


def test_vllm_structured_outputs_on_completions_and_chat(server):
    choice = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                              "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert choice["choices"][0]["text"] in ("yes", "no") and choice["choices"][0]["finish_reason"] == "stop"
    regex = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 1, "n": 3,
                                "structured_outputs": {"regex": "[0-9]{3}"}}).json()
    assert all(re.fullmatch("[0-9]{3}", c["message"]["content"]) for c in regex["choices"])
    schema = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 40, "temperature": 0.7, "seed": 2,
                                 "structured_outputs": {"json": SCHEMA}}).json()
    jsonschema.validate(json.loads(schema["choices"][0]["message"]["content"]), SCHEMA)
    grammar = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                               "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}).json()
    assert grammar["choices"][0]["text"] in ("yes", "no")
    obj = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 1.0, "seed": 4,
                                           "response_format": {"type": "json_object"}}).json()
    assert obj["choices"][0]["text"].lstrip().startswith("{")
    stream = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stream": True,
                                              "structured_outputs": {"choice": ["the lazy dog"]}}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "the lazy dog"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "is invalid"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "is invalid"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": ["a"], "jsn": {}}}, "structured_outputs.jsn", "unknown field"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "both constrain the output"),
    ({"tools": [WEATHER]}, "tool_choice", 'tool_choice "auto"'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "start the server with --tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "is invalid"),
]


@pytest.mark.parametrize("extra, param, message", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_constraints_are_400_naming_the_field(server, extra, param, message):
    from server_helpers import wait_idle
    r = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    wait_idle(server)  # nothing was queued


def test_a_grammar_that_fails_against_the_tokenizer_is_a_400_or_an_error_event(server):
    """The grammar passes the check without a tokenizer, so the request is accepted; compiled
    beside the engine loop against the tokenizer, it fails: that request alone ends, with the
    reason in an OpenAI error body."""
    import httpx
    grammar = {"structured_outputs": {"grammar": 'start: <|not_a_token|> "a"'}}
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **grammar})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("structured_outputs.grammar is invalid")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4, "stream": True, **grammar}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).status_code == 200


def test_tool_choice_returns_tool_calls(server):
    client = openai_client(server)
    named = client.chat.completions.create(
        model=model_name(server), messages=MESSAGES, tools=[WEATHER, NOOP], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("paris", "oslo")
    required = client.chat.completions.create(model=model_name(server), messages=MESSAGES, tools=[WEATHER, NOOP],
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=70,
                                              temperature=1.0, seed=5)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "noop") and isinstance(json.loads(call.function.arguments), dict)
    plain = client.chat.completions.create(model=model_name(server), messages=MESSAGES, tools=[WEATHER],
                                           tool_choice="none", max_tokens=3)
    assert plain.choices[0].message.tool_calls is None
    stream = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 60, "stream": True, "tools": [WEATHER],
                                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_mask_time_is_in_the_metrics(server):
    from server_helpers import metrics
    post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "[a-z]+"}})
    m = metrics(server)
    assert m["jaxserve_structured_output_mask_steps_total"] > 0
    assert m["jaxserve_structured_output_mask_seconds_total"] > 0


def test_the_served_state_is_what_the_openapi_document_says(server):
    """Once masks were filled, the state's stats hold a fraction of a second, which the document
    must call a number (it once said integer)."""
    import httpx
    from server_helpers import response_validator
    post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "[a-z]+"}})
    state = httpx.get(server.url + "/v1/engine/state").json()
    assert not float(state["stats"]["structured_output_mask_seconds"]).is_integer()
    response_validator(server, "/v1/engine/state").validate(state)


def test_a_large_body_is_validated_in_a_worker_with_the_same_answers(server, monkeypatch):
    """A body over PARSE_APART_BYTES is validated in a worker process and comes back with its
    schemas as text (docs/serving.md): the same constrained text as a body validated here, the
    same 400 for one that does not validate."""
    from jaxserve.entrypoints import request_body
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)},
              "required": ["p0", "p1"]}
    common = {"model": model_name(server), "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    bodies = [{**common, "structured_outputs": {"json": schema}},
              {**common, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
              {**common, "max_tokens": -1, "structured_outputs": {"json": schema}},
              {**common, "structured_outputs": {"json": {"type": "objekt", "properties": schema["properties"]}}}]

    def answers():
        replies = [post(server, "/v1/completions", body) for body in bodies]
        return [(r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()["error"])
                for r in replies]
    here = answers()
    assert [status for status, _ in here] == [200, 200, 400, 400], here
    assert here[0][1].startswith('{"p0":') and here[2][1]["param"] == "max_tokens"
    assert here[3][1]["param"] == "structured_outputs.json"
    monkeypatch.setattr(request_body, "PARSE_APART_BYTES", 512)  # every body here is larger
    monkeypatch.setattr(request_body, "validated", lambda *a: pytest.fail("validated in the API process"))
    assert answers() == here
