"""A GGUF copy without the tokenizer's arrays, for reference models that only need the weights.

transformers parses a GGUF with `gguf.GGUFReader`, which builds numpy objects per vocabulary entry:
for Gemma 3's 262k tokens and 515k merges that is about a minute of every model load (twice: the
config, then the tensors). The copy keeps every other metadata entry, the tensor infos and the
tensor data byte for byte, and says the vocabulary's size in `{arch}.vocab_size` if the file does
not (transformers looks there before counting the tokens).
"""

from __future__ import annotations

import struct

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar types
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def _skip_value(buf: bytes, vtype: int, pos: int) -> int:
    """The position after a value of `vtype` that starts at `pos`."""
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SIZES:
            return pos + count * _SIZES[etype]
        for _ in range(count):
            pos = _skip_value(buf, etype, pos)
        return pos
    return pos + _SIZES[vtype]


def copy_without_vocabulary(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        buf = f.read()
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, keys, kept, alignment, arch, vocab_size = 24, [], [], 32, None, None
    for _ in range(n_kv):
        start, n = pos, struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8:pos + 8 + n].decode()
        vtype = struct.unpack_from("<I", buf, pos + 8 + n)[0]
        value = pos + 12 + n
        pos = _skip_value(buf, vtype, value)
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, value)[0]
        elif key == "general.architecture":
            arch = buf[value + 8:pos].decode()
        elif key == "tokenizer.ggml.tokens":
            vocab_size = struct.unpack_from("<Q", buf, value + 4)[0]
        if not (vtype == _ARRAY and key.startswith("tokenizer.ggml.")):
            kept.append(buf[start:pos])
        keys.append(key)
    if f"{arch}.vocab_size" not in keys:
        name = f"{arch}.vocab_size".encode()
        kept.append(struct.pack("<Q", len(name)) + name + struct.pack("<II", _UINT32, vocab_size))
    infos = pos
    for _ in range(n_tensors):  # name, dimension count, dimensions, type, offset in the data
        n = struct.unpack_from("<Q", buf, pos)[0]
        n_dims = struct.unpack_from("<I", buf, pos + 8 + n)[0]
        pos += 8 + n + 4 + 8 * n_dims + 4 + 8
    head = buf[:16] + struct.pack("<Q", len(kept)) + b"".join(kept) + buf[infos:pos]
    with open(dst, "wb") as f:
        f.write(head + b"\0" * (-len(head) % alignment))
        f.write(memoryview(buf)[-(-pos // alignment) * alignment:])  # tensor offsets are relative to here
