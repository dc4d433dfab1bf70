"""A step's inputs in one int32 array [replicas, width]: the one host-to-device copy of a step.
The host packs a `StepBatch` (`pack`); the forward or decode program unpacks it (`unpack`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.worker.step_batch import StepBatch


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where a step's inputs sit in the one int32 array [replicas, width] the host copies to the
    device per step: each replica's row holds its slice of every input, one after another, and
    the table updates (the same in every row). The sampling rows' inputs are padded to W, so the
    forward program (one per token bucket) can hand them to the sample program (one per row
    bucket) as it hands over the hidden states."""

    tokens: int  # T per replica
    seqs: int  # S per replica
    rows: int  # W: the largest row bucket
    updates: int  # block-table entries (each 4 ints)
    decode_steps: bool = False  # with each token's, sequence's and row's steps (several decode steps)

    def sections(self) -> list[tuple[str, int]]:
        t, s, w = self.tokens, self.seqs, self.rows
        out = [("tokens", t), ("token_slots", t), ("positions", t), ("token_seq_slots", t), ("kv_lens", s),
               ("seq_slots", s), ("query_start", s + 1), ("num_seqs", 1), ("logits_indices", w),
               ("sample_positions", w), ("sample_slots", w), ("table_updates", 4 * self.updates)]
        return out + ([("token_steps", t), ("seq_steps", s), ("row_steps", w)] if self.decode_steps else [])

    def pack(self, batch: StepBatch, table_updates: np.ndarray, replicas: int, num_slots: int) -> np.ndarray:
        """[replicas, width] int32: the batch's inputs and table_updates [updates, 4]."""
        meta = batch.meta
        values = {"tokens": batch.tokens, "token_slots": batch.token_slots, "positions": meta.positions,
                  "token_seq_slots": batch.token_seq_slots, "kv_lens": meta.kv_lens, "seq_slots": batch.seq_slots,
                  "query_start": meta.query_start, "num_seqs": meta.num_seqs, "logits_indices": batch.logits_indices,
                  "sample_positions": batch.sample_positions, "sample_slots": batch.sample_slots,
                  "token_steps": batch.token_steps, "seq_steps": batch.seq_steps, "row_steps": batch.row_steps}
        pads = {"sample_slots": num_slots}  # a padding row's token is dropped
        parts = []
        for name, size in self.sections():
            if name == "table_updates":
                parts.append(np.broadcast_to(table_updates.reshape(1, -1), (replicas, size)))
                continue
            part = np.asarray(values[name], np.int32).reshape(replicas, -1)
            if part.shape[1] < size:  # a row bucket's inputs, padded to W
                part = np.pad(part, ((0, 0), (0, size - part.shape[1])), constant_values=pads.get(name, 0))
            parts.append(part)
        return np.concatenate(parts, axis=1)

    def unpack(self, packed) -> dict:
        """The inputs of `pack`, each [replicas * size] (table_updates [updates, 4]), on the device."""
        out, start = {}, 0
        for name, size in self.sections():
            part = packed[:, start: start + size]
            out[name] = part[0].reshape(-1, 4) if name == "table_updates" else part.reshape(-1)
            start += size
        return out
