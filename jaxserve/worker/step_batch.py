"""The host side of one ragged step: the scheduled sequences flattened into the fixed-shape arrays
the runner's compiled programs take, and the buckets that keep those shapes few.

    Schedule {request: tokens} ─► StepSeqs (columns) ─► build_step ─► StepBatch ─► StepLayout.pack
                                                                         (one int32 array a step)
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
        sampling_slots, sampling  the slots filled or freed since the last step, and their sampling
                            parameters (the rest stay on the device, per slot)
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
replica's tokens and sequences fill an equal, separately padded slice of every array. With
several decode steps per dispatch (`decode_steps`), the arrays are the first step's, and
token_steps, seq_steps and row_steps say how many steps each sequence runs.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxserve.model.paged_attention import StepMetadata
from jaxserve.worker.sampling import SamplingBatch


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step (tests and benchmarks build steps from these; see `StepSeqs.of`)."""

    slot: int  # its row in the slot table (block table, sampling parameters)
    start: int  # position of its first token this step: the tokens already in the pool
    token_ids: Sequence[int]  # a negative id: the token its last step sampled, still on the device
    samples: bool = True  # whether its last token here is its last uncomputed one


@dataclasses.dataclass
class StepSeqs:
    """The sequences of one step as columns [n], in step order (the scheduler fills them in one
    pass over its requests, with no object per sequence)."""

    slots: np.ndarray  # int64: each one's slot
    starts: np.ndarray  # int32: the position of its first token this step
    lens: np.ndarray  # int32: the tokens it runs
    token_ids: np.ndarray  # int32 [sum(lens)]: every sequence's tokens, one after another
    samples: np.ndarray  # bool: whether its last token here is its last uncomputed one

    @classmethod
    def of(cls, seqs: Sequence[ScheduledSeq]) -> "StepSeqs":
        return cls(np.array([s.slot for s in seqs], np.int64), np.array([s.start for s in seqs], np.int32),
                   np.array([len(s.token_ids) for s in seqs], np.int32),
                   np.array([t for s in seqs for t in s.token_ids], np.int32).reshape(-1),
                   np.array([s.samples for s in seqs], bool))


@dataclasses.dataclass
class StepBatch:
    tokens: np.ndarray  # [T] int32
    token_slots: np.ndarray  # [T] int32
    meta: StepMetadata  # slot_mapping and block_tables None: read on the device (`table_metadata`)
    logits_indices: np.ndarray  # [W] int32
    sample_positions: np.ndarray  # [R] int32
    sample_slots: np.ndarray  # [R] int32
    rows: np.ndarray  # [n] where each scheduled sequence's sampled token lands in the [R] outputs
    seq_slots: np.ndarray  # [S] int32
    token_seq_slots: np.ndarray  # [T] int32
    table_updates: np.ndarray  # [n, 4] int32 (slot, group, index, page)
    sampling_slots: np.ndarray  # [m] int32: the slots whose sampling parameters changed ...
    sampling: SamplingBatch  # [m] ... and their new ones
    sampling_mode: str = "cuts"  # the sample program's mode, one that covers every slot's parameters
    num_tokens: int = 0  # real tokens (the rest of T is padding)
    decode_steps: int = 1  # > 1: every sequence decodes, up to this many steps in one program ...
    token_steps: np.ndarray | None = None  # [T] int32 ... each token's sequence this many (padding: 0)
    seq_steps: np.ndarray | None = None  # [S] int32
    row_steps: np.ndarray | None = None  # [R] int32
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
    rows_per_seq: int = 1  # the rows a sequence may sample (speculation: 1 + its drafts)

    @functools.cached_property
    def token_sizes(self) -> list[int]:
        return _series(max(self.max_tokens, self.min_rows), self.min_rows)

    @functools.cached_property
    def row_sizes(self) -> list[int]:
        return _series(max(min(self.max_seqs * self.rows_per_seq, self.max_tokens), self.max_seqs, self.min_rows),
                       self.min_rows)

    @property
    def max_rows(self) -> int:
        """W: the hidden-state rows a forward program hands to the sampling program."""
        return self.row_sizes[-1]

    def seqs(self, tokens: int) -> int:
        """S: the sequence rows of a token bucket's metadata (a sequence runs at least one token)."""
        return max(min(tokens, self.max_seqs), self.min_rows)

    def shape(self, num_tokens: int, num_seqs: int, num_rows: int | None = None) -> tuple[int, int]:
        """(token bucket, row bucket) of a step; its sampling rows are its sequences unless given."""
        num_rows = num_seqs if num_rows is None else num_rows
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs or num_rows > self.max_rows:
            raise ValueError(f"a step of {num_tokens} tokens, {num_seqs} sequences and {num_rows} sampling rows "
                             f"exceeds the largest bucket ({self.max_tokens} tokens, {self.max_seqs} sequences, "
                             f"{self.max_rows} rows)")
        tokens, rows = self.token_sizes, self.row_sizes
        return tokens[bisect.bisect_left(tokens, num_tokens)], rows[bisect.bisect_left(rows, num_rows)]


_NO_SAMPLING_UPDATES = np.zeros(0, np.int32), SamplingBatch.greedy(0)  # no rows: nothing to change in them


def build_step(seqs: StepSeqs, num_slots: int, page_size: int, buckets: StepBuckets, replicas: int = 1,
               table_updates: np.ndarray | None = None, sampling_updates=None, sampling_mode: str = "cuts",
               decode_steps: np.ndarray | None = None, sample_rows: np.ndarray | None = None) -> StepBatch:
    """The padded arrays of one step, with numpy operations only (no pass per sequence in Python).
    table_updates [n, 4] and sampling_updates (slots [m], SamplingBatch [m]) go with the step to
    the device, where the slot table's block tables and sampling parameters live. decode_steps
    [n]: every sequence decodes (one token), each up to that many steps in one program; the
    arrays are its first step's, and the token bucket is the row bucket's (one program per row
    bucket). sample_rows [n]: how many of each sequence's last tokens sample a token after them
    (speculation: its last token and its drafts); `rows` then gives each sequence's first."""
    if sample_rows is not None:
        return _build_verifying_step(seqs, num_slots, buckets, table_updates, sampling_updates, sampling_mode,
                                     np.asarray(sample_rows, np.int32), replicas)
    n = len(seqs.slots)
    lens = seqs.lens.astype(np.int32)
    ends = np.cumsum(lens)  # over all replicas; each replica's own cumsum subtracts its start
    total = int(ends[-1]) if n else 0
    if replicas == 1:  # every sequence in step order, and none of the dealing below
        order, counts, token_counts = slice(None), np.array([n]), np.array([total])
    else:
        order, rep, index, counts, token_counts = _deal(seqs.slots, lens, replicas)
        lens = lens[order]
        ends = np.cumsum(lens)
    t_size, r_size = buckets.shape(int(token_counts.max(initial=0)), int(counts.max(initial=0)))
    if decode_steps is not None:
        t_size = buckets.shape(r_size, r_size)[0]
    s_size, w_size = buckets.seqs(t_size), buckets.max_rows
    slots, starts, samples = seqs.slots[order], seqs.starts[order], seqs.samples[order]
    starts_in_flat = ends - lens
    seq_of_token = np.repeat(np.arange(n), lens)
    offset_in_seq = np.arange(total) - starts_in_flat[seq_of_token]
    # Where each token, sequence, sampling row and logits row lands: with one replica, the first
    # rows of each array (slices, cheaper than scattering through indices)
    if replicas == 1:
        local_ends, flat_ids, last_tokens = ends, seqs.token_ids, ends - 1
        token_rows, seq_rows, sample_rows, logit_rows = slice(0, total), slice(0, n), slice(0, n), slice(0, n)
        query_rows, rows = (0, slice(1, n + 1)), np.arange(n)
    else:
        token_rows, flat_ids, local_ends = _dealt_tokens(seqs, order, rep, lens, token_counts, t_size,
                                                         seq_of_token, offset_in_seq)
        seq_rows, logit_rows, query_rows = rep * s_size + index, rep * w_size + index, (rep, index + 1)
        last_tokens = rep * t_size + local_ends - 1
        rows = np.zeros(n, np.int64)
        rows[order] = rep * r_size + index
        sample_rows = rows[order]

    tokens, token_slots, positions, token_seq_slots = _token_columns(
        replicas * t_size, token_rows, flat_ids, slots[seq_of_token], starts[seq_of_token] + offset_in_seq)

    kv_lens = np.zeros(replicas * s_size, np.int32)
    seq_slots = np.zeros(replicas * s_size, np.int32)
    kv_lens[seq_rows] = starts + lens
    seq_slots[seq_rows] = slots
    query_start = np.zeros((replicas, s_size + 1), np.int32)  # past a replica's last sequence: its total
    query_start[:, 1:] = token_counts[:, None]
    query_start[query_rows] = local_ends
    logits_indices = np.zeros(replicas * w_size, np.int32)
    logits_indices[logit_rows] = last_tokens
    sample_positions = np.zeros(replicas * r_size, np.int32)
    sample_slots = np.full(replicas * r_size, num_slots, np.int32)
    sample_positions[sample_rows] = starts + lens
    sample_slots[sample_rows] = np.where(samples, slots, num_slots)
    meta = StepMetadata(positions=positions, slot_mapping=None, kv_lens=kv_lens, block_tables=None,
                        query_start=query_start.reshape(-1), num_seqs=counts.astype(np.int32))
    sampling_slots, sampling = sampling_updates if sampling_updates is not None else _NO_SAMPLING_UPDATES
    batch = StepBatch(tokens, token_slots, meta, logits_indices, sample_positions, sample_slots, rows, seq_slots,
                      token_seq_slots, np.zeros((0, 4), np.int32) if table_updates is None else table_updates,
                      sampling_slots, sampling, sampling_mode, num_tokens=total)
    if decode_steps is not None:
        steps = np.asarray(decode_steps, np.int32)[order]
        batch.decode_steps = int(steps.max(initial=1))
        batch.token_steps, batch.seq_steps = np.zeros(len(tokens), np.int32), np.zeros(len(kv_lens), np.int32)
        batch.row_steps = np.zeros(len(sample_slots), np.int32)
        batch.token_steps[token_rows] = steps  # one token per sequence: token k is sequence k's
        batch.seq_steps[seq_rows] = steps
        batch.row_steps[sample_rows] = steps
        batch.num_tokens = int(steps.sum())
    return batch


def _build_verifying_step(seqs: StepSeqs, num_slots: int, buckets: StepBuckets, table_updates, sampling_updates,
                          sampling_mode: str, sample_rows: np.ndarray, replicas: int) -> StepBatch:
    """`build_step` where a sequence may sample after each of its last sample_rows[i] tokens: each
    such token has a logits row and samples the token at its position + 1. Sequences are dealt to
    replicas as there; a sequence's rows are consecutive within its replica's slice."""
    n, lens = len(seqs.slots), seqs.lens.astype(np.int32)
    order, rep, index, counts, token_counts = _deal(seqs.slots, lens, replicas)
    lens, row_lens = lens[order], sample_rows[order]
    row_counts = np.bincount(rep, weights=row_lens, minlength=replicas).astype(np.int64)
    t_size, r_size = buckets.shape(int(token_counts.max(initial=0)), int(counts.max(initial=0)),
                                   int(row_counts.max(initial=0)))
    s_size, w_size = buckets.seqs(t_size), buckets.max_rows
    slots, starts, samples = seqs.slots[order], seqs.starts[order], seqs.samples[order]
    ends = np.cumsum(lens)
    total = int(ends[-1]) if n else 0
    seq_of_token = np.repeat(np.arange(n), lens)
    offset_in_seq = np.arange(total) - (ends - lens)[seq_of_token]
    token_rows, flat_ids, local_ends = _dealt_tokens(seqs, order, rep, lens, token_counts, t_size, seq_of_token,
                                                     offset_in_seq)
    row_ends = np.cumsum(row_lens)
    num_rows = int(row_ends[-1]) if n else 0
    first_row = row_ends - row_lens - (np.cumsum(row_counts) - row_counts)[rep]  # within the replica
    seq_of_row = np.repeat(np.arange(n), row_lens)
    row_in_seq = np.arange(num_rows) - (row_ends - row_lens)[seq_of_row]
    row_rep = rep[seq_of_row]
    row_dest = first_row[seq_of_row] + row_in_seq  # within the replica
    token_of_row = row_rep * t_size + (local_ends - row_lens)[seq_of_row] + row_in_seq  # the token it follows

    tokens, token_slots, positions, token_seq_slots = _token_columns(
        replicas * t_size, token_rows, flat_ids, slots[seq_of_token], starts[seq_of_token] + offset_in_seq)
    kv_lens, seq_slots = np.zeros(replicas * s_size, np.int32), np.zeros(replicas * s_size, np.int32)
    kv_lens[rep * s_size + index], seq_slots[rep * s_size + index] = starts + lens, slots
    query_start = np.zeros((replicas, s_size + 1), np.int32)  # past a replica's last sequence: its total
    query_start[:, 1:] = token_counts[:, None]
    query_start[rep, index + 1] = local_ends
    logits_indices = np.zeros(replicas * w_size, np.int32)
    logits_indices[row_rep * w_size + row_dest] = token_of_row
    sample_positions = np.zeros(replicas * r_size, np.int32)
    sample_slots = np.full(replicas * r_size, num_slots, np.int32)
    sample_positions[row_rep * r_size + row_dest] = positions[token_of_row] + 1
    sample_slots[row_rep * r_size + row_dest] = np.where(samples, slots, num_slots)[seq_of_row]
    rows = np.zeros(n, np.int64)
    rows[order] = rep * r_size + first_row
    meta = StepMetadata(positions=positions, slot_mapping=None, kv_lens=kv_lens, block_tables=None,
                        query_start=query_start.reshape(-1), num_seqs=counts.astype(np.int32))
    sampling_slots, sampling = sampling_updates if sampling_updates is not None else _NO_SAMPLING_UPDATES
    return StepBatch(tokens, token_slots, meta, logits_indices, sample_positions, sample_slots, rows, seq_slots,
                     token_seq_slots, np.zeros((0, 4), np.int32) if table_updates is None else table_updates,
                     sampling_slots, sampling, sampling_mode, num_tokens=total)


def _deal(slots: np.ndarray, lens: np.ndarray, replicas: int) -> tuple:
    """Sequences dealt to data-parallel replicas by slot (slot % replicas), each replica's in step
    order: (order, their replicas [n] in that order, each one's place within its replica [n],
    sequences [replicas] and tokens [replicas] of each replica)."""
    replica = slots % replicas
    order = np.argsort(replica, kind="stable")  # replica 0's, then 1's, ...
    counts = np.bincount(replica, minlength=replicas)
    token_counts = np.bincount(replica, weights=lens, minlength=replicas).astype(np.int64)
    rep = replica[order]
    return order, rep, np.arange(len(slots)) - (np.cumsum(counts) - counts)[rep], counts, token_counts


def _dealt_tokens(seqs: StepSeqs, order, rep, lens, token_counts, t_size: int, seq_of_token, offset_in_seq) -> tuple:
    """For sequences dealt by `_deal` (`lens` in their order): (each token's row in the step's
    [replicas * t_size] token arrays, its id, each sequence's token end within its replica)."""
    local_ends = np.cumsum(lens) - (np.cumsum(token_counts) - token_counts)[rep]
    token_rows = rep[seq_of_token] * t_size + (local_ends - lens)[seq_of_token] + offset_in_seq
    src_start = (np.cumsum(seqs.lens) - seqs.lens)[order]  # the token ids in `order`
    return token_rows, seqs.token_ids[src_start[seq_of_token] + offset_in_seq], local_ends


def _token_columns(size: int, rows, ids: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> tuple:
    """A step's per-token arrays of `size` rows, its tokens at `rows` (a slice or indices): their
    ids (0 where the id is negative: the token is on the device, read through its slot), their
    slots (-1 elsewhere), their positions and their sequences' slots."""
    tokens, token_slots = np.zeros(size, np.int32), np.full(size, -1, np.int32)
    token_positions, token_seq_slots = np.zeros(size, np.int32), np.full(size, -1, np.int32)
    on_device = ids < 0
    tokens[rows] = np.where(on_device, 0, ids)
    token_slots[rows] = np.where(on_device, slots, -1)
    token_positions[rows] = positions
    token_seq_slots[rows] = slots
    return tokens, token_slots, token_positions, token_seq_slots


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
    meta = StepMetadata(positions=zeros(r * tokens), slot_mapping=None, kv_lens=zeros(r * seqs), block_tables=None,
                        query_start=zeros(r * (seqs + 1)), num_seqs=zeros(r))
    return StepBatch(zeros(r * tokens), zeros(r * tokens) - 1, meta, zeros(r * width), zeros(r * rows),
                     np.full(r * rows, max_slots, np.int32), zeros(0), zeros(r * seqs), zeros(r * tokens) - 1,
                     np.zeros((0, 4), np.int32), *_NO_SAMPLING_UPDATES, token_steps=zeros(r * tokens),
                     seq_steps=zeros(r * seqs), row_steps=zeros(r * rows))
