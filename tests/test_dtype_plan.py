"""The per-bucket weight dtype on CPU (`jaxserve.worker.dtype_plan`): each program takes the dtype its
timings make clearly faster, the one-row bucket exists only where it is the faster step, the
timings are measured once per machine and model and read back (never a damaged entry), and an
engine whose plan mixes dtypes runs each program on weights of its dtype, with nothing compiled
after warm-up."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.worker import dtype_plan, machine
from jaxserve.worker.dtype_plan import DtypePlan, plan_for
from jaxserve.model.config import ModelConfig

F32, BF16 = "float32", "bfloat16"


def table(rows: dict) -> dict:
    return {size: {F32: f32, BF16: bf16} for size, (f32, bf16) in rows.items()}


# Shaped like the AVX2-only AMD EPYC of docs/startup.md: float32 wins at one row and at many,
# bfloat16 between (ms per program).
FORWARD = table({1: (30, 60), 2: (60, 50), 4: (70, 55), 8: (90, 60), 16: (120, 110), 32: (200, 150), 64: (300, 400)})
SAMPLE = table({1: (40, 300), 2: (100, 70), 4: (110, 80), 8: (150, 100), 16: (200, 210), 32: (280, 270)})


def test_each_program_takes_the_dtype_that_is_clearly_faster():
    plan = DtypePlan(F32, FORWARD, SAMPLE)
    assert plan.min_rows == 1  # 30 + 40 ms against 50 + 70 at two rows
    assert dict(plan.programs()) == {
        ("forward", 1): F32, ("forward", 2): BF16, ("forward", 4): BF16, ("forward", 8): BF16,
        ("forward", 16): F32,  # bfloat16 only 8% faster: within the margin, the loaded dtype stays
        ("forward", 32): BF16, ("forward", 64): F32,
        ("sample", 1): F32, ("sample", 2): BF16, ("sample", 4): BF16, ("sample", 8): BF16,
        ("sample", 16): F32, ("sample", 32): F32}  # 270 against 280: within the margin
    assert plan.dtypes() == {F32, BF16}
    assert plan.describe() == ("per bucket, measured the faster here: layers at 1,16,64 in float32; layers at "
                               "2,4,8,32 in bfloat16; output layer at 1,16,32 in float32; output layer at 2,4,8 "
                               "in bfloat16")
    loaded_bf16 = dict(DtypePlan(BF16, FORWARD, SAMPLE).programs())
    assert loaded_bf16[("sample", 32)] == BF16 and loaded_bf16[("forward", 16)] == BF16  # the margin, the other way
    assert loaded_bf16[("forward", 1)] == F32 and loaded_bf16[("forward", 64)] == F32


def test_the_one_row_bucket_exists_only_where_a_one_row_step_is_clearly_faster():
    # bfloat16's one-row trap: float32 saves the output layer at one row, but two rows in
    # bfloat16 are faster still, so the smallest bucket is 2 and float32 is not needed at all.
    trap = DtypePlan(BF16, table({1: (30, 20), 2: (40, 22), 4: (50, 25)}), table({1: (40, 300), 2: (80, 30)}))
    assert trap.dtype("sample", 1) == F32
    assert trap.min_rows == 2
    assert dict(trap.programs()) == {("forward", 2): BF16, ("forward", 4): BF16, ("sample", 2): BF16}
    assert trap.dtypes() == {BF16} and trap.describe() == "measured the faster at every bucket"
    # A tiny model: every step is far under a millisecond, so no bucket or copy is worth its keep.
    tiny = DtypePlan(F32, table({1: (0.02, 0.05), 2: (0.03, 0.01)}), table({1: (0.1, 0.4), 2: (0.2, 0.1)}))
    assert tiny.min_rows == 2 and tiny.dtypes() == {F32}


def test_no_second_copy_where_it_would_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(dtype_plan, "available_memory", lambda: 1 << 16)
    plan = plan_for(CFG, [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32], F32, str(tmp_path / "plans.json"),
                    measure=lambda *_: as_json(FORWARD, SAMPLE))
    assert not plan.mixed and plan.dtypes() == {F32}
    assert plan.describe() == ("a copy in bfloat16, faster at some buckets, would not fit in a quarter of the "
                               "available memory")


def test_no_second_copy_that_makes_no_decode_batch_a_quarter_faster(tmp_path):
    # bfloat16 is 15-20% faster at every size: clearly faster, but not worth a second copy.
    forward = table({1: (10, 8.5), 2: (12, 10), 4: (14, 11.5)})
    sample = table({1: (20, 16), 2: (24, 20), 4: (30, 25)})
    assert DtypePlan(F32, forward, sample).dtypes() == {BF16}
    plan = plan_for(CFG, [1, 2, 4], [1, 2, 4], F32, str(tmp_path / "plans.json"),
                    measure=lambda *_: as_json(forward, sample))
    assert not plan.mixed and plan.dtypes() == {F32} and plan.min_rows == 1
    assert plan.describe() == "measured: a copy in bfloat16 would make no decode batch 25% faster"
    # At 35% faster, it is (and then every program runs in bfloat16: the engine loads only that).
    forward, sample = table({1: (10, 6.5), 2: (12, 7.8), 4: (14, 9)}), table({1: (20, 13), 2: (24, 15), 4: (30, 19)})
    plan = plan_for(CFG, [1, 2, 4], [1, 2, 4], F32, str(tmp_path / "other.json"),
                    measure=lambda *_: as_json(forward, sample))
    assert plan.mixed and plan.dtypes() == {BF16}


CFG = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)


def as_json(forward: dict, sample: dict) -> dict:
    return {"forward": {str(k): v for k, v in forward.items()}, "sample": {str(k): v for k, v in sample.items()}}


def test_timings_are_measured_once_per_machine_and_model_and_damage_is_measured_again(tmp_path):
    path, tokens, rows = str(tmp_path / "plans.json"), [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32]
    calls = []

    def measure(cfg, token_sizes, row_sizes):
        calls.append((cfg.hidden_size, list(token_sizes), list(row_sizes)))
        return as_json(FORWARD, SAMPLE)

    first = plan_for(CFG, tokens, rows, F32, path, measure=measure)
    assert first == DtypePlan(F32, FORWARD, SAMPLE) and len(calls) == 1
    assert plan_for(CFG, tokens, rows, F32, path, measure=measure) == first and len(calls) == 1  # read back
    plan_for(CFG, tokens[:-1], rows, F32, path, measure=measure)  # other buckets: measured for them
    assert calls[-1] == (64, tokens[:-1], rows)
    plan_for(dataclasses.replace(CFG, hidden_size=128), tokens, rows, F32, path, measure=measure)  # another model's shapes
    assert len(calls) == 3
    with open(path) as f:
        saved = json.load(f)
    assert len(saved) == 3
    del saved[dtype_plan._key(CFG, tokens, rows)]["sample"]["32"]  # an entry cut short
    with open(path, "w") as f:
        json.dump(saved, f)
    assert plan_for(CFG, tokens, rows, F32, path, measure=measure) == first and len(calls) == 4
    with open(path, "w") as f:
        f.write('{"truncated": ')  # not JSON at all
    assert plan_for(CFG, tokens, rows, F32, path, measure=measure) == first and len(calls) == 5


def test_a_folder_that_cannot_be_written_costs_a_measurement_not_the_start(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where the folder should be
    calls = []
    measure = lambda *_: calls.append(1) or as_json(FORWARD, SAMPLE)  # noqa: E731
    for _ in range(2):
        plan = plan_for(CFG, list(FORWARD), list(SAMPLE), F32, str(blocker / "plans.json"), measure=measure)
        assert plan == DtypePlan(F32, FORWARD, SAMPLE)
    assert len(calls) == 2 and "could not be saved" in caplog.text


def test_measure_dots_times_every_size_in_both_dtypes():
    timings = dtype_plan.measure_dots(CFG, [1, 2, 8], [1, 4], reps=1)
    assert set(timings["forward"]) == {"1", "2", "8"} and set(timings["sample"]) == {"1", "4"}
    assert all(set(times) == {F32, BF16} and all(ms > 0 for ms in times.values())
               for kind in timings.values() for times in kind.values())


def alternating(cfg, token_sizes, row_sizes):
    """Timings under which the two dtypes take turns by size, whatever dtype the machine loads."""
    def turns(sizes):  # a step at one row is the cheapest (float32 at 2 ms against 10 ms at two rows)
        return {str(s): {F32: 2.0 if s == 1 else 10.0, BF16: 30.0} if i % 2 == 0 else {F32: 30.0, BF16: 10.0}
                for i, s in enumerate(sizes)}
    return {"forward": turns(token_sizes), "sample": turns(row_sizes)}


@pytest.fixture(scope="module")
def mixed(llama_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_CACHE", str(tmp_path_factory.mktemp("dtype-plan-cache")))
        mp.setattr(dtype_plan, "measure_dots", alternating)
        mp.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # measured only without bf16 dots
        engine = Engine.from_pretrained(llama_dir, EngineConfig(max_slots=4, page_size=8, num_pages=64,
                                                                max_model_len=128, max_num_batched_tokens=16))
        engine.warmup()
        yield engine


def test_a_mixed_plan_runs_each_program_on_weights_of_its_dtype(mixed):
    runner = mixed.runner
    assert set(runner.states) == {F32, BF16}
    planned = dict(runner.config.program_dtypes)
    assert set(planned) == {k[:2] for k in runner.all_programs() if k[0] in ("forward", "sample")}  # every mode
    assert set(planned.values()) == {F32, BF16}
    assert runner.buckets.min_rows == 1  # a 4 ms step at one row against 20 ms at two
    for key, dtype in planned.items():
        embed = runner.bodies.model(runner.state_for(key)).embed[...]  # the weights that program takes
        assert embed.dtype == jnp.dtype(dtype), key
    assert "per bucket, measured the faster here" in mixed.describe()


def test_a_mixed_plan_serves_every_bucket_without_a_compile_after_warmup(mixed, llama_dir):
    before = mixed.stats()["num_compiles"]
    work = [list(range(3, 3 + n)) for n in (1, 5, 9, 14)]  # prompts across token buckets, 1 to 4 rows
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2 if i % 2 else None)
              for i in range(4)]
    got = mixed.generate(work, params)
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in got)
    assert mixed.stats()["num_compiles"] == before
    reference = Engine.from_pretrained(llama_dir, EngineConfig(max_slots=4, page_size=8, num_pages=64,
                                                               max_model_len=128, dtype="float32"))
    expected = reference.generate(work, params)
    # Some programs hold bfloat16 weights: the first greedy token of a random tiny model mostly survives.
    assert sum(g.token_ids[0] == e.token_ids[0] for g, e in zip(got, expected)) >= 3


def test_a_cpu_with_bfloat16_dots_keeps_one_dtype_without_measuring(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    monkeypatch.setattr(dtype_plan, "measure_dots", lambda *_: pytest.fail("measured"))
    engine = Engine.from_pretrained(llama_dir, EngineConfig(max_slots=4, page_size=8, num_pages=64,
                                                            max_model_len=128, max_num_batched_tokens=16))
    assert engine.runner.config.program_dtypes == () and len(engine.runner.states) == 1
    assert not (tmp_path / "dtype_plans.json").exists()
