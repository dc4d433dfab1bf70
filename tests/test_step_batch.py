"""build_step's arrays, worked out by hand: one replica (each array's first rows), and two (each
replica's slice padded on its own)."""

from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, StepSeqs, build_step


def _step(replicas: int, slots: tuple[int, int]):
    # a decode whose token is on the device (slot slots[0], 10 tokens in the pool), then a prompt
    # chunk of 3 tokens that does not sample (slot slots[1])
    seqs = StepSeqs.of([ScheduledSeq(slots[0], 10, [-1]), ScheduledSeq(slots[1], 0, [5, 6, 7], samples=False)])
    return build_step(seqs, num_slots=4, page_size=16, buckets=StepBuckets(max_tokens=8, max_seqs=4 // replicas),
                      replicas=replicas)


def test_one_replica_fills_the_first_rows_of_each_array():
    b = _step(1, (3, 1))
    assert b.shape == (4, 2)
    assert b.tokens.tolist() == [0, 5, 6, 7] and b.token_slots.tolist() == [3, -1, -1, -1]
    assert b.meta.positions.tolist() == [10, 0, 1, 2] and b.token_seq_slots.tolist() == [3, 1, 1, 1]
    assert b.meta.kv_lens.tolist() == [11, 3, 0, 0] and b.seq_slots.tolist() == [3, 1, 0, 0]
    assert b.meta.query_start.tolist() == [0, 1, 4, 4, 4] and b.meta.num_seqs.tolist() == [2]
    assert b.logits_indices.tolist() == [0, 3, 0, 0] and b.rows.tolist() == [0, 1]
    assert b.sample_positions.tolist() == [11, 3] and b.sample_slots.tolist() == [3, 4]
    assert b.num_tokens == 4


def test_two_replicas_deal_sequences_by_slot():
    b = _step(2, (3, 2))  # slot 3 to replica 1, slot 2 to replica 0
    assert b.shape == (8, 2)  # per replica: 4 tokens, 1 sampling row
    assert b.tokens.tolist() == [5, 6, 7, 0, 0, 0, 0, 0] and b.token_slots.tolist() == [-1, -1, -1, -1, 3, -1, -1, -1]
    assert b.meta.positions.tolist() == [0, 1, 2, 0, 10, 0, 0, 0]
    assert b.token_seq_slots.tolist() == [2, 2, 2, -1, 3, -1, -1, -1]
    assert b.meta.kv_lens.tolist() == [3, 0, 11, 0] and b.seq_slots.tolist() == [2, 0, 3, 0]
    assert b.meta.query_start.tolist() == [0, 3, 3, 0, 1, 1] and b.meta.num_seqs.tolist() == [1, 1]
    assert b.logits_indices.tolist() == [2, 0, 4, 0] and b.rows.tolist() == [1, 0]
    assert b.sample_positions.tolist() == [3, 11] and b.sample_slots.tolist() == [4, 3]


def test_a_verifying_step_on_two_replicas_keeps_each_sequences_rows_together():
    # speculation: slot 3 (replica 1) runs its last token, on the device, and drafts 8, 9 from
    # position 10; slot 2 (replica 0) runs token 5 and draft 6 from position 4; every token samples
    seqs = StepSeqs.of([ScheduledSeq(3, 10, [-1, 8, 9]), ScheduledSeq(2, 4, [5, 6])])
    b = build_step(seqs, num_slots=4, page_size=16, buckets=StepBuckets(max_tokens=8, max_seqs=2, rows_per_seq=3),
                   replicas=2, sample_rows=[3, 2])
    assert b.shape == (8, 8)  # per replica: 4 tokens, 4 sampling rows
    assert b.tokens.tolist() == [5, 6, 0, 0, 0, 8, 9, 0] and b.token_slots.tolist() == [-1, -1, -1, -1, 3, -1, -1, -1]
    assert b.meta.positions.tolist() == [4, 5, 0, 0, 10, 11, 12, 0]
    assert b.meta.kv_lens.tolist() == [6, 0, 13, 0] and b.seq_slots.tolist() == [2, 0, 3, 0]
    assert b.meta.query_start.tolist() == [0, 2, 2, 0, 3, 3] and b.meta.num_seqs.tolist() == [1, 1]
    w = len(b.logits_indices) // 2
    assert b.logits_indices[:3].tolist() == [0, 1, 0] and b.logits_indices[w:w + 4].tolist() == [4, 5, 6, 0]
    assert b.rows.tolist() == [4, 0]  # each sequence's first row: slot 3's in replica 1's slice
    assert b.sample_positions.tolist() == [5, 6, 0, 0, 11, 12, 13, 0]
    assert b.sample_slots.tolist() == [2, 2, 4, 4, 3, 3, 3, 4]
