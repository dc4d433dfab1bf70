"""llama.cpp as a benchmark peer: greedy batched generation through llama-cpp-python's C API.

Up to `max_batch` sequences share one context: prompts are prefilled in `n_batch`-token chunks,
then every step decodes one token for each live sequence in a single `llama_decode` call, and a
finished sequence's KV is dropped so the next request takes its place.
"""

from __future__ import annotations

import time

import numpy as np


def generate_batched(path: str, prompts: list[list[int]], output_lens: list[int], *, max_batch: int,
                     threads: int, n_batch: int = 2048) -> list[float]:
    """Generates output_lens[i] greedy tokens after prompts[i]; returns each request's finish time
    in seconds after the model was loaded and its context made (the engine's figures leave out its
    load and compilation too)."""
    import llama_cpp as lc

    quiet = lc.llama_log_callback(lambda level, text, user_data: None)  # kept alive until the end
    lc.llama_log_set(quiet, None)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    params = lc.llama_context_default_params()
    params.n_ctx = longest * min(max_batch, len(prompts))
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = min(max_batch, len(prompts))
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True  # one KV buffer shared by all sequences: batched decoding attends in one op
    ctx = lc.llama_init_from_model(model, params)
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(n_batch, 0, 1)
    start = time.monotonic()
    finish = [0.0] * len(prompts)
    waiting = list(range(len(prompts)))
    free_seqs = list(range(params.n_seq_max))
    live: dict[int, tuple[int, int, int]] = {}  # seq id -> (request, next position, tokens left)
    last_token: dict[int, int] = {}

    def decode(items: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """items: (token, position, seq id, wants logits) -> greedy next token per seq wanting logits."""
        out = {}
        for begin in range(0, len(items), n_batch):
            chunk = items[begin: begin + n_batch]
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            batch.n_tokens = len(chunk)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                    out[seq] = int(row.argmax())
        return out

    try:
        while waiting or live:
            items = []
            while waiting and free_seqs:  # admit: prefill whole prompts
                request, seq = waiting.pop(0), free_seqs.pop()
                prompt = prompts[request]
                items += [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
                live[seq] = (request, len(prompt), output_lens[request])
            items += [(last_token[seq], live[seq][1], seq, True) for seq in live if seq in last_token]
            for seq, token in decode(items).items():
                request, pos, left = live[seq]
                pos = pos + 1 if seq in last_token else pos
                left -= 1
                last_token[seq] = token
                live[seq] = (request, pos, left)
                if left == 0:
                    finish[request] = time.monotonic() - start
                    del live[seq], last_token[seq]
                    lc.llama_memory_seq_rm(memory, seq, -1, -1)
                    free_seqs.append(seq)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return finish
