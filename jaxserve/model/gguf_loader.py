"""GGUF checkpoints: metadata to `ModelConfig`, tensors dequantized to the canonical flat weights.

    cfg, weights = load_gguf("gemma-3-270m-q4_k_m.gguf")                 # float32
    cfg, weights = load_gguf("gemma-3-270m-q4_k_m.gguf", dtype="bfloat16")

Every block type `gguf.quants` can dequantize (Q4_K, Q6_K, Q8_0, Q5_0, ... plus F32, F16, BF16)
is turned into float32, or bfloat16 on request; asked for int8 weights, Q8_0 matrices are taken as
stored (`read_q8_0`) and the others quantized from float32. Large tensors are dequantized a slab of rows at a
time straight into the output array, so the peak memory is the output plus one slab.
The header is read by a small parser here (see `GGUFFile`), not `gguf.GGUFReader`, which spends
~9 s and ~0.75 GB building per-token numpy objects for Gemma 3's vocabulary.

Layout facts this module relies on:
- GGUF lists a tensor's dimensions fastest-first (`[in, out]` for a matrix); in numpy order that
  is `[out, in]`, i.e. PyTorch's layout (`GGUFTensorInfo.dims` is numpy order). Canonical matrices are `[in, out]`, so
  every projection is transposed; the embedding `[V, D]` is not.
- llama.cpp's converter permutes the rows of Q and K of `llama`-architecture models into
  interleaved-pair RoPE order; we undo it to get Hugging Face's rotate-half layout. Gemma 3 is
  converted without that permutation.
- The Gemma converter stores RMSNorm weights as `1 + w`, which is exactly the canonical multiplier,
  so they are taken as they are.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any, Callable

import numpy as np

from jaxserve.model.config import ModelConfig, RopeScaling
from jaxserve.model.quantization import STORED, quantize_matrices, stored_int8
from jaxserve.model.weights import SCALES, check_weights

SUPPORTED_ARCHITECTURES = ("gemma3", "llama")

# Gemma 3 facts that llama.cpp hard-codes rather than storing in the file.
_GEMMA3_SLIDING_PATTERN = 6  # five sliding layers, then one global
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0

# Slab size for chunked dequantization, in output elements.
_CHUNK_ELEMENTS = 1 << 22

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm",
    "ffn_norm": "mlp_norm",
    "post_ffw_norm": "post_mlp_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_MATRICES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
_BIASES = {"attn_q": "q_bias", "attn_k": "k_bias", "attn_v": "v_bias"}


# ----------------------------------------------------------------------------------------------
# Reading the file
#
# gguf.GGUFReader builds a numpy object per vocabulary entry (about a million for Gemma 3's 262144
# tokens): seconds and most of a GB just to open the file. This small parser reads the same format with
# one bounds-checked cursor, so a truncated file names the byte where it ends. Tensor data stays
# memory-mapped and is dequantized with `gguf.quants`.

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # numpy order (slowest first): [out, in] for a matrix
    qtype: Any  # gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > self.size:
            raise ValueError(f"{self.path}: the file is truncated: reading {what} needs bytes "
                             f"{self.pos}..{end} but the file ends at byte {self.size}")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def scalar(self, code: str, what: str):
        dt = np.dtype(code)
        return np.frombuffer(self.take(dt.itemsize, what), dt)[0].item()

    def string(self, what: str) -> str:
        n = self.scalar("<u8", what)
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, what)  # raises the truncation error
            n = unpack(buf, pos)[0]
            if pos + 8 + n > size:
                self.pos = pos + 8
                self.take(n, what)
            out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar("<u4", what)
            count = self.scalar("<u8", what)
            if etype == _STRING:
                return self.strings(count, what)
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype])
                arr = np.frombuffer(self.take(dt.itemsize * count, what), dt).copy()
                return arr.astype(bool) if etype == _BOOL else arr
            if etype == _ARRAY:
                return [self.value(_ARRAY, what) for _ in range(count)]
            raise ValueError(f"{self.path}: {what} has unknown array element type {etype}")
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype], what)
            if vtype == _BOOL:
                return bool(v)
            if vtype == 6:  # stored as float32: 1e-6 arrives as 9.99999997e-07
                return _shortest_float(v)
            return v
        raise ValueError(f"{self.path}: {what} has unknown value type {vtype}")


def _shortest_float(value: float) -> float:
    """The shortest decimal that maps to the same float32, so 1e-6 stays 1e-06."""
    return float(str(np.float32(value)))


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> Python value; numeric arrays as numpy arrays),
    `tensors` (name -> GGUFTensorInfo) and `data` (the memory-mapped bytes)."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        if os.path.isdir(path):
            raise ValueError(f"{path}: is a directory, expected a .gguf file")
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"{path}: the file is empty (0 bytes), not a GGUF file")
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self.data), path)
        magic = bytes(cur.take(4, "the GGUF magic"))
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        self.version = cur.scalar("<u4", "the version")
        if self.version not in (2, 3):
            hint = " (big-endian files are not supported)" if self.version & 0xFFFF == 0 else ""
            raise ValueError(f"{path}: GGUF version {self.version} is not supported (2 or 3){hint}")
        n_tensors = cur.scalar("<u8", "the tensor count")
        n_kv = cur.scalar("<u8", "the metadata count")
        if n_tensors > size or n_kv > size:
            raise ValueError(f"{path}: corrupt header ({n_tensors} tensors, {n_kv} metadata entries "
                             f"in a {size}-byte file)")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata entry {i}")
            vtype = cur.scalar("<u4", f"metadata {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor info {i}")
            n_dims = cur.scalar("<u4", f"tensor info {name!r}")
            if n_dims > 8:
                raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions (corrupt header?)")
            dims = np.frombuffer(cur.take(8 * n_dims, f"tensor info {name!r}"), "<u8").tolist()
            raw_type = cur.scalar("<u4", f"tensor info {name!r}")
            offset = cur.scalar("<u8", f"tensor info {name!r}")
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"{path}: tensor {name!r} has unknown GGML type id {raw_type} "
                                 "(not supported by the installed gguf package)") from None
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: invalid general.alignment {alignment}")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, qtype, offset in infos:
            if name in self.tensors:
                raise ValueError(f"{path}: duplicate tensor {name!r}")
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[-1] % block:
                raise ValueError(f"{path}: tensor {name!r} row length {dims[-1]} is not a multiple of "
                                 f"the {qtype.name} block size {block}")
            n_bytes = n_elems // block * type_size
            start = data_start + offset
            if start + n_bytes > size:
                raise ValueError(f"{path}: the file is truncated: tensor {name!r} needs bytes "
                                 f"{start}..{start + n_bytes} but the file ends at byte {size}")
            self.tensors[name] = GGUFTensorInfo(name, dims, qtype, start, n_bytes)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def raw(self, name: str) -> np.ndarray:
        """The stored rows of a tensor, as gguf.quants expects them: for block types `uint8` of
        shape `[..., bytes per row]`, for F32/F16/F64 the elements themselves."""
        import gguf

        t = self.tensors[name]
        buf = self.data[t.offset:t.offset + t.n_bytes]
        plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                 gguf.GGMLQuantizationType.F64: np.float64}
        if t.qtype in plain:
            return buf.view(plain[t.qtype]).reshape(t.dims)
        block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
        dims = t.dims or (1,)
        return buf.reshape(*dims[:-1], dims[-1] // block * type_size)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parses a GGUF file's header (tensor data stays memory-mapped).

    FileNotFoundError for a missing path; ValueError naming the path for anything that is not a
    complete GGUF file (truncated, empty, bad magic, unknown tensor type).
    """
    return GGUFFile(path)


def _require(meta: dict, key: str, path: str):
    if key not in meta:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return meta[key]


def _uniform(value, what: str, path: str):
    """A per-layer metadata array that must hold one value for every layer, as that value."""
    if value is None or not np.ndim(value):
        return value
    values = sorted(set(np.asarray(value).tolist()))
    if len(values) != 1:
        raise ValueError(f"{path}: per-layer {what} {values} are not supported")
    return values[0]


def _rope_scaling(g) -> RopeScaling | None:
    """`g(key, default)`: the architecture's metadata value."""
    kind = g("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, llama3)")
    return RopeScaling(kind="linear", factor=float(g("rope.scaling.factor", 1.0)))


def _llama3_factors(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes to `rope_freqs` for llama3 scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, s.factor, mid))


def _llama3_from_rope_freqs(freqs: np.ndarray, head_dim: int, theta: float, g, path: str) -> RopeScaling | None:
    """llama.cpp stores Llama 3.1-style RoPE scaling only as the `rope_freqs` tensor; recover the
    Hugging Face parameters by matching it against the standard ones."""
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    if freqs.shape != (head_dim // 2,):
        raise ValueError(f"{path}: rope_freqs has shape {freqs.shape}, expected ({head_dim // 2},)")
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    originals = {int(g("rope.scaling.original_context_length", 8192)), 8192}
    for orig in sorted(originals):
        for low, high in ((1.0, 4.0),):
            cand = RopeScaling(kind="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                               original_max_position_embeddings=orig)
            if np.allclose(_llama3_factors(head_dim, theta, cand), freqs, rtol=1e-4, atol=1e-5):
                return cand
    raise ValueError(f"{path}: the rope_freqs tensor does not match llama3 RoPE scaling with standard "
                     "parameters (low_freq_factor 1, high_freq_factor 4); this scaling is not supported")


def config_from_metadata(meta: dict, tensor_shapes: dict[str, tuple[int, ...]], path: str = "<gguf>",
                         rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Builds the ModelConfig from GGUF metadata; `tensor_shapes` are numpy-order shapes by GGUF name."""
    arch = _require(meta, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    hidden = int(_require(meta, f"{arch}.embedding_length", path))
    layers = int(_require(meta, f"{arch}.block_count", path))
    heads = int(_require(meta, f"{arch}.attention.head_count", path))
    kv_heads = _uniform(g("attention.head_count_kv", heads), "kv head counts", path)
    ffn = _uniform(g("feed_forward_length"), "feed-forward widths", path)
    if ffn is None:
        ffn = tensor_shapes["blk.0.ffn_up.weight"][0]
    head_dim = int(g("attention.key_length", hidden // heads))
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key_length {head_dim} != value_length {g('attention.value_length')} "
                         "is not supported")
    rope_dims = g("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count {rope_dims} < head dim "
                         f"{head_dim}) are not supported")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(tensor_shapes["token_embd.weight"][0])
    eos = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and meta[key] not in eos:
            eos.append(meta[key])
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )

    family = _gemma3_config if arch == "gemma3" else _llama_config
    return family(g, common, tensor_shapes, path, rope_freqs)


def _gemma3_config(g, common: dict, tensor_shapes: dict, path: str, rope_freqs) -> ModelConfig:
    """Gemma 3: sliding and global layers by the pattern, each with its RoPE base."""
    layers, hidden, heads, head_dim = (common[k] for k in ("num_layers", "hidden_size", "num_heads", "head_dim"))
    theta = float(g("rope.freq_base", 1_000_000.0))
    window = int(g("attention.sliding_window", 4096))
    pattern = g("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if np.ndim(pattern):  # newer files: one bool per layer, true = sliding
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    if len(sliding) != layers:
        raise ValueError(f"{path}: sliding_window_pattern has {len(sliding)} entries for {layers} layers")
    # llama.cpp: the 27B model (62 layers) scales queries by hidden/heads, the others by head_dim.
    query_pre_attn_scalar = hidden // heads if layers == 62 else head_dim
    return ModelConfig(
        family="gemma3",
        max_position_embeddings=int(g("context_length", 32768)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(g),
        tie_embeddings=True,
        qk_norm=True,
        activation="gelu_tanh",
        layer_windows=tuple(window if s else None for s in sliding),
        layer_rope_thetas=tuple(_GEMMA3_LOCAL_ROPE_THETA if s else theta for s in sliding),
        embed_scale=math.sqrt(hidden),
        sandwich_norms=True,
        query_scale=query_pre_attn_scalar ** -0.5,
        final_logit_softcap=g("final_logit_softcapping"),
        attn_logit_softcap=g("attn_logit_softcapping"),
        **common,
    )


def _llama_config(g, common: dict, tensor_shapes: dict, path: str, rope_freqs) -> ModelConfig:
    """The Llama family: one window (or none) for every layer; Llama 3's RoPE scaling from a rope_freqs tensor."""
    head_dim, layers = common["head_dim"], common["num_layers"]
    theta = float(g("rope.freq_base", 10_000.0))
    scaling = _rope_scaling(g)
    if rope_freqs is not None:
        if scaling is not None:
            raise ValueError(f"{path}: both rope.scaling.type and a rope_freqs tensor are present")
        scaling = _llama3_from_rope_freqs(rope_freqs, head_dim, theta, g, path)
    window = g("attention.sliding_window")
    return ModelConfig(
        family="llama",
        max_position_embeddings=int(g("context_length", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        activation="silu",
        layer_windows=(int(window) if window else None,) * layers,
        **common,
    )


# ----------------------------------------------------------------------------------------------
# Tensors


def _target_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not supported (use 'float32' or 'bfloat16')") from None
    if dt.name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not supported (use 'float32' or 'bfloat16')")
    return dt


def _dequantizer(f: GGUFFile, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """A function mapping raw rows of tensor `name` to float32 rows; ValueError for types that
    gguf.quants cannot dequantize."""
    import gguf

    t = f.tensors[name]
    qtype = t.qtype
    if qtype == gguf.GGMLQuantizationType.F32:
        return lambda raw: raw
    if qtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F64):
        return lambda raw: raw.astype(np.float32)
    if qtype in (gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16,
                 gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64):
        raise ValueError(f"{f.path}: tensor {name!r} has integer type {qtype.name}, "
                         "which is not a weight type this loader supports")
    fn = lambda raw: gguf.quants.dequantize(raw, qtype)  # noqa: E731
    raw = f.raw(name)
    try:
        fn(raw.reshape(-1, raw.shape[-1])[:1])
    except NotImplementedError:
        raise ValueError(f"{f.path}: tensor {name!r} uses quantization type {qtype.name}, which the "
                         "installed gguf package cannot dequantize") from None
    return fn


def read_tensor(f: GGUFFile, name: str, dtype="float32", *, transpose: bool = False,
                row_perm: np.ndarray | None = None) -> np.ndarray:
    """Dequantizes one tensor into a fresh contiguous array of `dtype`, in numpy order (`[out, in]`
    for a matrix; `[in, out]` with `transpose`). `row_perm` reorders the rows (output features)."""
    out_dtype = _target_dtype(dtype)
    shape = f.tensors[name].dims
    deq = _dequantizer(f, name)
    raw = f.raw(name)
    if len(shape) <= 1:
        return np.array(deq(raw.reshape(1, -1)).reshape(shape), dtype=out_dtype)
    if len(shape) != 2:
        raise ValueError(f"{f.path}: tensor {name!r} has {len(shape)} dimensions, expected 1 or 2")
    rows, cols = shape
    if row_perm is not None:  # only for the small Q/K matrices: dequantize whole, then permute
        full = deq(raw)[row_perm]
        return np.ascontiguousarray(full.T if transpose else full, dtype=out_dtype)
    out = np.empty((cols, rows) if transpose else (rows, cols), dtype=out_dtype)
    step = max(1, _CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        block = deq(raw[r0:r0 + step]).reshape(-1, cols)
        if transpose:
            out[:, r0:r0 + step] = block.T
        else:
            out[r0:r0 + step] = block
    return out


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation.

    The converter maps each head's rows from rotate-half order [x0..x(d/2-1), y0..y(d/2-1)] to
    interleaved order [x0, y0, x1, y1, ...] (reshape (heads, 2, d/2) -> swap -> (heads, d/2, 2)).
    Row `i` of the Hugging Face layout is therefore row `perm[i]` of the GGUF tensor.
    """
    if n_rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {n_rows} rows into {n_head} heads of even size")
    half = n_rows // n_head // 2
    gguf_index = np.arange(n_rows).reshape(n_head, half, 2)  # gguf row of (head, pair j, component c)
    return gguf_index.swapaxes(1, 2).reshape(-1)  # HF order: (head, component c, pair j)


def read_q8_0(f: GGUFFile, name: str, *, transpose: bool = False,
              row_perm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 matrix as stored: (int8 values, float16 scales [out, in / 32]), each block being 32
    weights along `in` with its scale, in numpy order (`[in, ...]` with `transpose`). That is
    int8's own layout (`jaxserve.model.quantization`), so nothing passes through float."""
    rows, cols = f.tensors[name].dims
    blocks = f.raw(name).reshape(rows, cols // 32, 34)  # a float16 scale, then 32 int8 values
    values = blocks[..., 2:].view(np.int8).reshape(rows, cols)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if row_perm is not None:
        values, scales = values[row_perm], scales[row_perm]
    return tuple(np.ascontiguousarray(a.T if transpose else a) for a in (values, scales))


def load_gguf(path: str | os.PathLike, dtype="float32", quantization: str | None = None
              ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads a GGUF file into `(ModelConfig, canonical weights)`; see the module docstring. With
    `quantization` ("int8", "w8a8"), the matrices come as int8 beside their scales
    (`jaxserve.model.weights`): Q8_0 ones as stored where the mode's scales are Q8_0's, the others
    dequantized and quantized again."""
    import gguf

    path = os.fspath(path)
    out_dtype = _target_dtype(dtype)
    group = STORED[quantization] if quantization else None
    f = open_gguf(path)
    meta = f.metadata
    shapes = {name: t.dims for name, t in f.tensors.items()}
    rope_freqs = None
    if "rope_freqs.weight" in f.tensors and meta.get("general.architecture") == "llama":
        rope_freqs = read_tensor(f, "rope_freqs.weight")
    cfg = config_from_metadata(meta, shapes, path, rope_freqs)
    permuted = cfg.family == "llama"  # llama.cpp permutes Q/K only for the llama architecture

    def perm_for(kind: str, n_rows: int):
        if not (permuted and kind in ("attn_q", "attn_k")):
            return None
        return _unpermute_rows(n_rows, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)

    def matrix(name: str, canon: str, **layout):
        if not quantization:
            return {canon: read_tensor(f, name, out_dtype, **layout)}
        if not stored_int8(canon, quantization):
            return {canon: read_tensor(f, name, "float32", **layout)}  # int8's layers: rounded by the engine
        if group == 32 and f.tensors[name].qtype == gguf.GGMLQuantizationType.Q8_0:
            values, scales = read_q8_0(f, name, **layout)
            return {canon: values, canon + SCALES: scales}
        return {canon: read_tensor(f, name, "float32", **layout)}  # quantized below, from float32

    weights: dict[str, np.ndarray] = {}
    unknown = []
    for name in f.tensors:
        if name == "rope_freqs.weight":
            continue
        if name == "token_embd.weight":
            weights |= matrix(name, "embed")
            continue
        if name == "output_norm.weight":
            weights["final_norm"] = read_tensor(f, name, out_dtype)
            continue
        if name == "output.weight":
            if not cfg.tie_embeddings:
                weights |= matrix(name, "lm_head", transpose=True)
            continue  # a tied model (Gemma 3) needs no second copy of the embedding
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < cfg.num_layers:
            prefix, kind, suffix = f"layers.{int(parts[1])}.", parts[2], parts[3]
            if suffix == "weight" and kind in _LAYER_TENSORS:
                canon = _LAYER_TENSORS[kind]
                perm = perm_for(kind, shapes[name][0])
                weights |= (matrix(name, prefix + canon, transpose=True, row_perm=perm) if canon in _MATRICES
                            else {prefix + canon: read_tensor(f, name, out_dtype, row_perm=perm)})
                continue
            if suffix == "bias" and kind in _BIASES:
                bias = read_tensor(f, name, out_dtype)
                perm = perm_for(kind, bias.shape[0])
                weights[prefix + _BIASES[kind]] = bias if perm is None else bias[perm]
                continue
        unknown.append(name)
    if unknown:
        raise ValueError(f"{path}: unexpected tensor(s) for architecture {cfg.family!r}: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if quantization:
        weights = quantize_matrices(weights, quantization)
    check_weights(cfg, weights, path)
    return cfg, weights
