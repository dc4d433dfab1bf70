"""Saves a randomly initialised Hugging Face checkpoint with Gemma 3 270M's shapes.

For speed runs on a machine the real weights cannot reach (a lent accelerator with no network):
the step's cost depends on the shapes, not on the values. Needs torch and transformers. The
tokenizer is a small word-level one; the benchmarks send token ids, and ids it does not know
decode to nothing.

  python scripts/random_checkpoint.py /tmp/gemma3-270m-random
  python scripts/bench_batching.py --model /tmp/gemma3-270m-random ...
"""

from __future__ import annotations

import argparse
import json
import os

# Gemma 3 270M (google/gemma-3-270m config.json): 18 layers, five sliding-window layers per global one.
GEMMA3_270M = dict(
    vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    max_position_embeddings=32_768, query_pre_attn_scalar=256, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
)


def save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    args = parser.parse_args(argv)
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3_270M))
    model.to(torch.bfloat16).eval().save_pretrained(args.path)
    save_tokenizer(args.path)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M random parameters to {args.path}")


if __name__ == "__main__":
    main()
