"""Speculative drafts from a smaller model of the same vocabulary (`{"method": "draft_model",
"model": PATH}`).

The draft model has a runner of its own (its weights and compiled steps) whose KV pool has the
target's page geometry and is addressed by the target's page ids: the pages a sequence holds hold
its draft K/V beside its target K/V, with no accounting of their own (the KV budget counts a page
as both pools' bytes: `build_runner`'s `draft`). Each pass sends the block-table
entries of the sequences it runs, whole, so the draft's tables never depend on the target's.

    Scheduler._draft reserves up to K draft tokens, and their pages, per decoding request ─►
    DraftModel.propose(schedule), before the step is built:
        catch up: each drafting sequence's tokens from the first whose draft K/V is not written
                  through its last token (its prompt the first time; after a step, the tokens it
                  kept), in passes within the step's token budget; the last one samples draft 1
        then K - 1 passes of one token a sequence: draft j - 1 in, draft j out
    ─► the step verifies the drafts as it verifies n-gram ones (`speculation.accepted`)

A draft is the draft model's greedy token: for a draft distribution that puts all its mass on one
token, keeping the draft exactly where the target samples that same token is the rejection
sampling of Leviathan et al. and Chen et al. (2023), so outputs are the target's, greedy or
sampled. Draft K/V past what a step kept is stale: it lies past the sequence's length, where the
next catch-up writes over it.
"""

from __future__ import annotations

import numpy as np

from jaxserve.engine.batching.request import Request
from jaxserve.engine.resources import build_runner
from jaxserve.model.config import ModelConfig
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import Runner
from jaxserve.worker.step_batch import StepSeqs, build_step


class DraftModel:
    @staticmethod
    def read(config, target: ModelConfig) -> tuple[ModelConfig, dict]:
        """The config and weights of `config.speculative`'s draft model (an EngineConfig's), for a
        target of config `target`; ValueError if its vocabulary is not the target's."""
        path = config.speculative.model
        model_config, weights, _, _ = load_model(path, config.weights_dtype)
        if model_config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {path} has a vocabulary of {model_config.vocab_size} tokens, the "
                             f"target {target.vocab_size}: a draft model must share the target's tokenizer")
        return model_config, weights

    @classmethod
    def load(cls, config, draft: tuple[ModelConfig, dict], runner: Runner, backend: str) -> "DraftModel":
        """The draft model `read` gave, with a runner of its own whose KV pool has the pages of
        the target's `runner`."""
        model_config, weights = draft
        if model_config.max_position_embeddings < runner.config.max_model_len:
            raise ValueError(f"the draft model {config.speculative.model} reads {model_config.max_position_embeddings} "
                             f"positions, fewer than max_model_len ({runner.config.max_model_len})")
        draft_config = config.replace(num_pages=runner.config.num_pages, kv_cache_bytes=None, speculative=None,
                                      max_model_len=runner.config.max_model_len, quantization=None)
        return cls(build_runner(draft_config, model_config, weights, backend)[0], config.max_slots)

    def __init__(self, runner: Runner, max_slots: int):
        """`runner`: the draft model's, with the target's pages (`num_pages`, `page_size`)."""
        self.runner = runner
        self.max_slots = max_slots
        self.page_size = runner.config.page_size
        self.budget = runner.config.max_num_batched_tokens
        # per sequence: how many of its first tokens have draft K/V in its pages, and its preemptions then
        self._written: dict[Request, tuple[int, int]] = {}
        self.num_passes = 0

    def propose(self, drafts: dict[Request, list[int]], grammars) -> None:
        """Fills each request's reserved drafts (`drafts[r]`, K placeholders or fewer) with the draft
        model's greedy tokens after its last one. A request with a grammar (in `grammars`, the
        engine's `GrammarMatchers`) draws each under its grammar's mask after the drafts before it,
        and stops drafting where the grammar takes no more; its matcher is left as it was. Every
        request decodes: its last token is on the host, at position `num_computed_tokens`."""
        self._written = {r: w for r, w in self._written.items() if not r.finished}
        wanted = {r: len(d) for r, d in drafts.items()}
        out: dict[Request, list[int]] = {r: [] for r in drafts}
        constrained = {r for r in drafts if r.request_id in grammars}

        def take(r: Request, token: int) -> None:
            if r in constrained:  # the next draft's mask comes after this one
                if not grammars.valid_prefix(r.request_id, [token]):
                    wanted[r] = len(out[r])  # the grammar is complete: no draft after it
                    return
                grammars.consume(r.request_id, token)
            out[r].append(token)

        # catch up, then draft 1: the tokens from the first without draft K/V (a preempted sequence's
        # are in pages it gave up) through the last one
        todo = {}
        for r in drafts:
            written, preemptions = self._written.get(r, (0, r.num_preemptions))
            todo[r] = min(written, r.num_computed_tokens) if preemptions == r.num_preemptions else 0
        tables = _table_entries(drafts)
        while todo:
            room, run = self.budget, []
            for r, start in todo.items():
                n = min(r.num_computed_tokens + 1 - start, room)
                if n > 0:
                    run.append((r, start, n))
                    room -= n
            sampled = self._pass(run, tables, grammars)
            tables = None
            for (r, start, n), token in zip(run, sampled):
                todo[r] = start + n
                if todo[r] == r.num_computed_tokens + 1:
                    take(r, token)
                    del todo[r]
        # drafts 2..K: one token a sequence a pass
        for j in range(1, max(wanted.values(), default=0)):
            run = [(r, r.num_computed_tokens + j, 1) for r in drafts if wanted[r] > j]
            for (r, _, _), token in zip(run, self._pass(run, None, grammars, [out[r][-1] for r, _, _ in run])):
                take(r, token)
        for r in constrained:  # back to the last token: the step's own masks start there
            grammars.rollback(r.request_id, len(out[r]))
        for r in drafts:
            self._written[r] = r.num_computed_tokens + len(out[r]), r.num_preemptions  # through the last draft's input
            drafts[r] = out[r]

    def recover(self) -> None:
        """After a failed step: a pool the failure consumed is replaced (zeroed), so no draft K/V is left."""
        if self.runner.recover():
            self._written.clear()

    def _pass(self, run: list[tuple[Request, int, int]], tables: np.ndarray | None, grammars,
              tokens: list[int] | None = None) -> list[int]:
        """One step of the draft model: each (request, start, n) runs its tokens start..start+n
        (or, given `tokens`, that one token) and samples greedily after the last, under its
        grammar's mask if it has one; the sampled token of each (the caller knows which count)."""
        ids = [t for r, start, n in run for t in r.token_ids(start, start + n)] if tokens is None else tokens
        seqs = StepSeqs(np.array([r.slot for r, _, _ in run], np.int64), np.array([s for _, s, _ in run], np.int32),
                        np.array([n for _, _, n in run], np.int32), np.array(ids, np.int32),
                        np.ones(len(run), bool))
        batch = build_step(seqs, self.max_slots, self.page_size, self.runner.buckets, self.runner.replicas,
                           tables, None, "greedy")
        constrained = [(r.request_id, int(row), ()) for (r, _, _), row in zip(run, batch.rows)
                       if r.request_id in grammars]
        if constrained:
            batch.allowed, _ = grammars.fill(constrained, len(batch.sample_slots))
        self.num_passes += 1
        return self.runner.step(batch).tokens[batch.rows].tolist()


def _table_entries(requests) -> np.ndarray:
    """[n, 4] (slot, group, index, page): every block-table entry of the requests' pages."""
    entries = [(r.slot, g, i, page) for r in requests for g, pages in enumerate(r.pages) for i, page in enumerate(pages)]
    return np.array(entries, np.int32).reshape(-1, 4)
