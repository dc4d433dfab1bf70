"""The host side of one ragged step: the scheduled sequences flattened into the fixed-shape arrays
the runner's compiled programs take, and the buckets that keep those shapes few.

    Schedule {request: tokens} ─► ScheduledSeq per request ─► StepBatch
        tokens [T]          the tokens to run, sequence after sequence (decodes first)
        token_slots [T]     for a token still on the device (sampled by the step before): the slot
                            whose last sampled token it is; -1 for tokens given here
        meta                positions [T]; kv_lens, query starts [S] (StepMetadata; G KV-cache
                            groups). Its block tables [S, G, W] and pool slots [T, G] are read on
                            the device from the slot table (`table_metadata`), so no array of the
                            step grows with max_model_len (W pages)
        seq_slots [S]       each sequence row's slot: its rows of the slot table (padding: 0)
        token_seq_slots [T] each token's slot (padding: -1, the null page)
        table_updates [n, 4] (slot, group, index, page): the slot table's entries written since the
                            last step, applied on the device before it runs
        logits_indices [W]  each sequence's last token: the only rows that reach the output layer
        sampling [R]        each sequence's sampling parameters
        sample_positions [R] the position of the token each sequence samples (its sampling key)
        sample_slots [R]    the slot each sampling sequence's token is kept in on the device (for
                            the next step); out of range for the others
        allowed [R, M]      bitmasks of the tokens each row may sample (structured output), set
                            by the engine after `build_step` when some row is constrained; None:
                            every token (the runner passes its own all-ones mask of that shape)

T is padded to a token bucket, and S follows from it (min(T, max_seqs)): the model's forward
program is compiled once per token bucket. R, the rows that reach the output layer and the
sampler, is padded to a row bucket of its own, and W is the largest row bucket: the program that
samples is compiled once per row bucket, whatever the step's tokens. Padding tokens write to the
null page and belong to no sequence; padding sequences have no tokens and length 0. Under a
data-parallel mesh the sequences are dealt to replicas by slot (slot % replicas), and each
replica's tokens and sequences fill an equal, separately padded slice of every array.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxserve.model.paged_attention import StepMetadata
from jaxserve.worker.sampling import SamplingBatch


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step."""

    slot: int  # its row in the slot table (block table, sampling parameters)
    start: int  # position of its first token this step: the tokens already in the pool
    token_ids: Sequence[int]  # a negative id: the token its last step sampled, still on the device
    samples: bool = True  # whether its last token here is its last uncomputed one


@dataclasses.dataclass
class StepBatch:
    tokens: np.ndarray  # [T] int32
    token_slots: np.ndarray  # [T] int32
    meta: StepMetadata  # slot_mapping and block_tables None: read on the device (`table_metadata`)
    logits_indices: np.ndarray  # [W] int32
    sampling: SamplingBatch  # [R] rows
    sample_positions: np.ndarray  # [R] int32
    sample_slots: np.ndarray  # [R] int32
    rows: np.ndarray  # [n] where each scheduled sequence's sampled token lands in the [R] outputs
    seq_slots: np.ndarray  # [S] int32
    token_seq_slots: np.ndarray  # [T] int32
    table_updates: np.ndarray  # [n, 4] int32 (slot, group, index, page)
    num_tokens: int = 0  # real tokens (the rest of T is padding)
    allowed: np.ndarray | None = None  # [R, ceil(V / 32)] int32 token bitmasks; None: no row is constrained

    @property
    def shape(self) -> tuple[int, int]:
        """(tokens, sampling rows) of the padded batch."""
        return len(self.tokens), len(self.sample_slots)


def _series(high: int, low: int = 1) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... (powers of two, and their midpoints from 16 on), then
    high; from `low` on."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        if size < 16:
            size *= 2
        else:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return sizes + [high]


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The padded shapes of a replica's slice of a step: tokens and sampling rows, apart.

    Tokens round up in steps of at most 1.5x (padding <= 33%, far less on average) up to the token
    budget; a token bucket's sequence metadata has min(tokens, max_seqs) rows. The rows that reach
    the output layer and the sampler (one per sequence) round up on the same series to max_seqs,
    whatever the tokens: a prompt chunk of 256 tokens alone samples 2 rows, not 32.
    """

    max_tokens: int  # per replica
    max_seqs: int  # per replica
    min_rows: int = 1  # the smallest token and row size

    @property
    def token_sizes(self) -> list[int]:
        return _series(max(self.max_tokens, self.min_rows), self.min_rows)

    @property
    def row_sizes(self) -> list[int]:
        return _series(max(self.max_seqs, self.min_rows), self.min_rows)

    @property
    def max_rows(self) -> int:
        """W: the hidden-state rows a forward program hands to the sampling program."""
        return self.row_sizes[-1]

    def seqs(self, tokens: int) -> int:
        """S: the sequence rows of a token bucket's metadata (a sequence runs at least one token)."""
        return max(min(tokens, self.max_seqs), self.min_rows)

    def shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """(token bucket, row bucket) of a step."""
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            raise ValueError(f"a step of {num_tokens} tokens and {num_seqs} sequences exceeds the largest "
                             f"bucket ({self.max_tokens} tokens, {self.max_seqs} sequences)")
        return (next(s for s in self.token_sizes if s >= num_tokens),
                next(s for s in self.row_sizes if s >= num_seqs))


def build_step(seqs: Sequence[ScheduledSeq], sampling: SamplingBatch, page_size: int, buckets: StepBuckets,
               replicas: int = 1, table_updates: np.ndarray | None = None) -> StepBatch:
    """The padded arrays of one step. sampling ([slots] rows) is the slot table's, and each
    sequence reads its slot's row; table_updates [n, 4] go with the step to the device."""
    num_slots = len(sampling.temperature)
    groups: list[list[int]] = [[] for _ in range(replicas)]
    for i, seq in enumerate(seqs):
        groups[seq.slot % replicas].append(i)
    t_size, r_size = buckets.shape(max(sum(len(seqs[i].token_ids) for i in g) for g in groups),
                                   max(len(g) for g in groups))
    s_size, w_size = buckets.seqs(t_size), buckets.max_rows
    tokens = np.zeros(replicas * t_size, np.int32)
    positions = np.zeros(replicas * t_size, np.int32)
    kv_lens = np.zeros(replicas * s_size, np.int32)
    seq_slots = np.zeros(replicas * s_size, np.int32)
    query_start = np.zeros(replicas * (s_size + 1), np.int32)
    num_seqs = np.zeros(replicas, np.int32)
    logits_indices = np.zeros(replicas * w_size, np.int32)
    slots = np.zeros(replicas * r_size, np.int64)
    sample_positions = np.zeros(replicas * r_size, np.int32)
    sample_slots = np.full(replicas * r_size, num_slots, np.int32)
    slot_of_token = np.full(replicas * t_size, -1, np.int64)
    real = np.zeros(replicas * r_size, bool)
    rows = np.zeros(len(seqs), np.int64)
    for r, group in enumerate(groups):
        n = len(group)
        t0, s0, r0 = r * t_size, r * s_size, r * r_size
        lens = np.fromiter((len(seqs[i].token_ids) for i in group), np.int32, n)
        starts = np.fromiter((seqs[i].start for i in group), np.int32, n)
        ends = np.cumsum(lens, dtype=np.int32)
        total = int(ends[-1]) if n else 0
        seq_of_token = np.repeat(np.arange(n), lens)
        pos = starts[seq_of_token] + np.arange(total, dtype=np.int32) - (ends - lens)[seq_of_token]
        group_slots = np.fromiter((seqs[i].slot for i in group), np.int64, n)
        tokens[t0: t0 + total] = [t for i in group for t in seqs[i].token_ids]
        sample_slots[r0: r0 + n] = np.where([seqs[i].samples for i in group], group_slots, num_slots)
        positions[t0: t0 + total] = pos
        slot_of_token[t0: t0 + total] = group_slots[seq_of_token]
        kv_lens[s0: s0 + n] = starts + lens
        seq_slots[s0: s0 + n] = group_slots
        q0 = r * (s_size + 1)
        query_start[q0 + 1: q0 + 1 + n] = ends
        query_start[q0 + 1 + n: q0 + 1 + s_size] = total
        num_seqs[r] = n
        logits_indices[r * w_size: r * w_size + n] = t0 + ends - 1
        sample_positions[r0: r0 + n] = starts + lens
        slots[r0: r0 + n] = group_slots
        real[r0: r0 + n] = True
        rows[group] = r0 + np.arange(n)
    meta = StepMetadata(positions=positions, slot_mapping=None, kv_lens=kv_lens, block_tables=None,
                        query_start=query_start, num_seqs=num_seqs)
    on_device = tokens < 0
    return StepBatch(np.where(on_device, 0, tokens), np.where(on_device, slot_of_token, -1).astype(np.int32), meta,
                     logits_indices, _sampling_rows(sampling, slots, real), sample_positions, sample_slots, rows,
                     seq_slots, slot_of_token.astype(np.int32),
                     np.zeros((0, 4), np.int32) if table_updates is None else table_updates,
                     num_tokens=sum(len(seq.token_ids) for seq in seqs))


def table_metadata(meta: StepMetadata, block_tables, seq_slots, token_seq_slots, page_size: int) -> StepMetadata:
    """`meta` with the block tables [S, G, W] and pool slots [T, G] of its sequences and tokens,
    read from the slot table block_tables [slots, G, W] (on the device in a step; numpy or jax
    arrays alike). A padding token (slot -1) writes offset 0 of the null page."""
    xp = np if isinstance(block_tables, np.ndarray) else jnp
    pages = block_tables[xp.maximum(token_seq_slots, 0), :, meta.positions // page_size]  # [T, G]
    offsets = (meta.positions % page_size)[:, None]
    slot_mapping = xp.where((token_seq_slots >= 0)[:, None], pages * page_size + offsets, 0).astype(np.int32)
    return dataclasses.replace(meta, slot_mapping=slot_mapping, block_tables=block_tables[seq_slots])


def table_updates(block_tables: np.ndarray) -> np.ndarray:
    """[n, 4] (slot, group, index, page): every entry of a host slot table [slots, G, W] that is
    not the null page, as updates of an empty table (for callers that build whole tables)."""
    index = np.argwhere(block_tables != 0)
    return np.concatenate([index, block_tables[tuple(index.T)][:, None]], axis=1).astype(np.int32)


def _sampling_rows(sampling: SamplingBatch, slots: np.ndarray, real: np.ndarray) -> SamplingBatch:
    """Each sequence's sampling parameters; padding rows greedy and unfiltered (no sorting path)."""
    def rows(values, pad):
        return np.where(real, np.asarray(values)[slots], pad).astype(np.asarray(values).dtype)
    return SamplingBatch(rows(sampling.temperature, 0), rows(sampling.top_k, 0), rows(sampling.top_p, 1),
                         rows(sampling.min_p, 0), rows(sampling.seed, 0))


def pad_updates(updates: np.ndarray, start: int, size: int, drop_slot: int) -> np.ndarray:
    """Rows start.. start + size of table updates [n, 4], padded to `size` rows that drop (slot
    `drop_slot`, past the table): the fixed shape of `write_table_entries`."""
    chunk = np.full((size, 4), drop_slot, np.int32)
    part = updates[start: start + size]
    chunk[: len(part)] = part
    return chunk


def write_table_entries(block_tables, updates):
    """block_tables [slots, G, W] (on the device) with the entries of updates [U, 4] (slot, group,
    index, page) written; rows past the table drop."""
    slot, group, index, page = updates.T
    return block_tables.at[slot, group, index].set(page, mode="drop")


def padding_batch(tokens: int, rows: int, buckets: StepBuckets, max_slots: int, replicas: int = 1) -> StepBatch:
    """A step of `tokens` tokens and `rows` sampling rows (per replica) that is all padding: it
    writes only the null page (the shapes a program is compiled for)."""
    r, seqs, width = replicas, buckets.seqs(tokens), buckets.max_rows
    zeros = lambda n: np.zeros(n, np.int32)  # noqa: E731
    greedy = SamplingBatch(np.zeros(r * rows, np.float32), zeros(r * rows), np.ones(r * rows, np.float32),
                           np.zeros(r * rows, np.float32), np.zeros(r * rows, np.uint32))
    meta = StepMetadata(positions=zeros(r * tokens), slot_mapping=None, kv_lens=zeros(r * seqs), block_tables=None,
                        query_start=zeros(r * (seqs + 1)), num_seqs=zeros(r))
    return StepBatch(zeros(r * tokens), zeros(r * tokens) - 1, meta, zeros(r * width), greedy, zeros(r * rows),
                     np.full(r * rows, max_slots, np.int32), zeros(0), zeros(r * seqs), zeros(r * tokens) - 1,
                     np.zeros((0, 4), np.int32))
