// Decode attention on a CPU, as an XLA FFI handler (jaxserve/cpu_kernels/decode_attention.py builds it).
//
// One query row per sequence, a decode step's, against that sequence's keys and values in the
// paged pool, read in place through its block table: what `_decode_rows` in
// jaxserve/pallas_kernels/ragged_reference.py computes with jnp, where XLA:CPU runs each block's
// small batched dots ([G, D] by [D, L] per sequence) at a seventh of the memory's speed
// (docs/kernels.md). For each sequence s and kv head n, with G = H / N query heads on it:
//
//   out[s, n G + g] = sum_t softmax_t(cap(scale * q[s, n G + g] . k[t])) v[t]
//
// over the positions t in [max(length - window, 0), length), where cap is soft_cap * tanh(x /
// soft_cap) (none when soft_cap is 0); zeros for a sequence with no key (length 0: no decode row).
//
//   q [S, H, D] float32; k, v [N, Λ, M, P, D] float32, bfloat16 or uint16 holding its bits, `layer`
//   picking the layer; lengths [S]; tables [S, W] page ids; window a scalar; out [S, H, D] float32.
//
// With a bfloat16 pool, q and the probabilities are rounded to bfloat16 before they meet it, as
// the reference's dots round them. D is a multiple of 16; the caller checks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::parallel_for;

namespace {

constexpr int64_t kKeys = 64;  // keys a block: their rows (converted from bfloat16) stay in the L1/L2 cache
constexpr int64_t kPart = 256;  // the fewest keys a thread takes of a sequence split between threads

struct Attention {
  const float* q;
  const void *k, *v;
  bool bf16;
  const int32_t* lengths;
  const int32_t* tables;
  int64_t heads, kv_heads, layers, pages, page_size, dim, width, layer, window;
  float scale, soft_cap;
  float* out;
};

float round_bf16(float x) {  // to the nearest bfloat16, ties to even (XLA's conversion)
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

// The first position sequence s's window reaches (its keys: [first, length)).
int64_t window_start(const Attention& a, int64_t s) { return std::max<int64_t>(a.lengths[s] - a.window, 0); }

// The rows of keys [t0, t1) of sequence s's kv head n in `pool`, as float32: pointers into the pool,
// or, for a bfloat16 pool, into `buffer` [kKeys, D], where they are widened.
void rows_of(const Attention& a, const void* pool, int64_t s, int64_t n, int64_t t0, int64_t t1, float* buffer,
             const float** rows) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t page = a.tables[s * a.width + t / a.page_size];
    int64_t at = (((n * a.layers + a.layer) * a.pages + page) * a.page_size + t % a.page_size) * a.dim;
    if (!a.bf16) {
      rows[t - t0] = static_cast<const float*>(pool) + at;
      continue;
    }
    const uint16_t* bits = static_cast<const uint16_t*>(pool) + at;
    float* row = buffer + (t - t0) * a.dim;
#if defined(__AVX2__)
    for (int64_t d = 0; d < a.dim; d += 8) {
      __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + d)));
      _mm256_storeu_ps(row + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#else
    for (int64_t d = 0; d < a.dim; ++d) {
      uint32_t wide = uint32_t{bits[d]} << 16;
      std::memcpy(row + d, &wide, 4);
    }
#endif
    rows[t - t0] = row;
  }
}

float dot(const float* x, const float* y, int64_t n) {
#if defined(__AVX2__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), s1);
  }
  __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
#else
  float s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
#endif
}

// acc[g] += sum_i p[g * stride + i] * rows[i] for GG heads: 16 values of D at a time, their sums
// in registers while the keys go by.
template <int GG>
void add_values(const float* const* rows, int64_t keys, const float* p, int64_t stride, int64_t dim, float* acc) {
#if defined(__AVX2__)
  for (int64_t d = 0; d < dim; d += 16) {
    __m256 lo[GG], hi[GG];
    for (int g = 0; g < GG; ++g) {
      lo[g] = _mm256_loadu_ps(acc + g * dim + d);
      hi[g] = _mm256_loadu_ps(acc + g * dim + d + 8);
    }
    for (int64_t i = 0; i < keys; ++i) {
      __m256 v0 = _mm256_loadu_ps(rows[i] + d), v1 = _mm256_loadu_ps(rows[i] + d + 8);
      for (int g = 0; g < GG; ++g) {
        __m256 w = _mm256_broadcast_ss(p + g * stride + i);
        lo[g] = _mm256_fmadd_ps(w, v0, lo[g]);
        hi[g] = _mm256_fmadd_ps(w, v1, hi[g]);
      }
    }
    for (int g = 0; g < GG; ++g) {
      _mm256_storeu_ps(acc + g * dim + d, lo[g]);
      _mm256_storeu_ps(acc + g * dim + d + 8, hi[g]);
    }
  }
#else
  for (int g = 0; g < GG; ++g)
    for (int64_t i = 0; i < keys; ++i)
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p[g * stride + i] * rows[i][d];
#endif
}

// Sequence s's G query heads on kv head n, over its keys at positions [t0, t1): acc [G, D] =
// sum_t e_t v[t] with e_t = exp(score_t - most[g]), and total[g] = sum_t e_t (0 for no key).
// scratch: this thread's, grown as needed.
void attend(const Attention& a, int64_t s, int64_t n, int64_t t0, int64_t t1, float* acc, float* most, float* total,
            std::vector<float>& scratch) {
  int64_t group = a.heads / a.kv_heads, dim = a.dim, count = std::max<int64_t>(t1 - t0, 0);
  std::fill(acc, acc + group * dim, 0.0f);
  std::fill(total, total + group, 0.0f);
  std::fill(most, most + group, 0.0f);
  if (count == 0) return;
  scratch.resize(group * dim + group * count + kKeys * dim);
  float *q = scratch.data(), *p = q + group * dim, *buffer = p + group * count;
  const float* rows[kKeys];
  const float* query = a.q + (s * a.heads + n * group) * dim;
  for (int64_t i = 0; i < group * dim; ++i) q[i] = a.bf16 ? round_bf16(query[i]) : query[i];

  for (int64_t i0 = 0; i0 < count; i0 += kKeys) {  // the scores
    int64_t keys = std::min(kKeys, count - i0);
    rows_of(a, a.k, s, n, t0 + i0, t0 + i0 + keys, buffer, rows);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < keys; ++i) {
        float score = dot(q + g * dim, rows[i], dim) * a.scale;
        p[g * count + i0 + i] = a.soft_cap > 0 ? a.soft_cap * std::tanh(score / a.soft_cap) : score;
      }
  }
  for (int64_t g = 0; g < group; ++g) {  // the probabilities, unnormalized; their sum
    float* row = p + g * count;
    most[g] = *std::max_element(row, row + count);
    for (int64_t i = 0; i < count; ++i) {
      float e = std::exp(row[i] - most[g]);
      total[g] += e;
      row[i] = a.bf16 ? round_bf16(e) : e;
    }
  }
  for (int64_t i0 = 0; i0 < count; i0 += kKeys) {  // the values
    int64_t keys = std::min(kKeys, count - i0);
    rows_of(a, a.v, s, n, t0 + i0, t0 + i0 + keys, buffer, rows);
    for (int64_t g = 0; g < group; g += 4) {
      const float* pg = p + g * count + i0;
      switch (std::min<int64_t>(4, group - g)) {
        case 1: add_values<1>(rows, keys, pg, count, dim, acc + g * dim); break;
        case 2: add_values<2>(rows, keys, pg, count, dim, acc + g * dim); break;
        case 3: add_values<3>(rows, keys, pg, count, dim, acc + g * dim); break;
        default: add_values<4>(rows, keys, pg, count, dim, acc + g * dim); break;
      }
    }
  }
}

// out [G, D] from the parts of one sequence's keys (acc [parts, G, D], most and total [parts, G]),
// each weighed by exp(its most - the largest); zeros for no key.
void merge(const float* acc, const float* most, const float* total, int64_t parts, int64_t group, int64_t dim,
           float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float largest = -INFINITY, sum = 0;
    for (int64_t j = 0; j < parts; ++j)
      if (total[j * group + g] > 0) largest = std::max(largest, most[j * group + g]);
    std::fill(out + g * dim, out + (g + 1) * dim, 0.0f);
    for (int64_t j = 0; j < parts; ++j) {
      if (total[j * group + g] == 0) continue;
      float weight = std::exp(most[j * group + g] - largest);
      sum += weight * total[j * group + g];
      for (int64_t d = 0; d < dim; ++d) out[g * dim + d] += weight * acc[(j * group + g) * dim + d];
    }
    if (sum > 0)
      for (int64_t d = 0; d < dim; ++d) out[g * dim + d] /= sum;
  }
}

ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> tables,
                            ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out, float scale,
                            float soft_cap) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  bool bf16 = k.element_type() == ffi::DataType::U16 || k.element_type() == ffi::DataType::BF16;
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || lengths.element_count() != qd[0] || td[0] != qd[0] ||
      layer.element_count() != 1 || window.element_count() != 1)
    return ffi::Error::InvalidArgument("decode_attention: q must be [S, H, D], the pool [N, layers, M, P, D], "
                                       "lengths [S], tables [S, W], layer and window scalars");
  if (k.element_type() != v.element_type() || (!bf16 && k.element_type() != ffi::DataType::F32) ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin()) || kd[4] != qd[2] || qd[2] % 16 ||
      qd[1] % kd[0])
    return ffi::Error::InvalidArgument("decode_attention: k and v must match, float32, bfloat16 or its bits, "
                                       "with q's head dim (a multiple of 16) and a divisor of its heads");
  Attention a{q.typed_data(), k.untyped_data(), v.untyped_data(), bf16, lengths.typed_data(), tables.typed_data(),
              qd[1], kd[0], kd[1], kd[2], kd[3], qd[2], td[1], *layer.typed_data(), *window.typed_data(), scale,
              soft_cap, out->typed_data()};
  if (a.layer < 0 || a.layer >= a.layers)
    return ffi::Error::InvalidArgument("decode_attention: the layer is out of the pool");
  int64_t longest = 0;  // keys of the sequence with the most
  for (int64_t s = 0; s < qd[0]; ++s) {  // every page a sequence's keys are read from is in the pool
    int64_t length = a.lengths[s], first = window_start(a, s);
    if (length > a.width * a.page_size)
      return ffi::Error::InvalidArgument("decode_attention: a sequence is longer than its block table");
    for (int64_t w = first / a.page_size; w * a.page_size < length; ++w)
      if (a.tables[s * a.width + w] < 0 || a.tables[s * a.width + w] >= a.pages)
        return ffi::Error::InvalidArgument("decode_attention: a block table names a page outside the pool");
    longest = std::max(longest, length - first);
  }
  // A sequence and kv head a piece of work; with fewer of those than threads, a long sequence's
  // keys are split into parts of at least kPart keys, their softmaxes merged after.
  int64_t group = a.heads / a.kv_heads, items = qd[0] * a.kv_heads;
  if (items == 0) return ffi::Error::Success();
  int64_t parts = std::max<int64_t>(1, std::min(pool.num_threads() / items, longest / kPart));
  std::vector<float> acc(items * parts * group * a.dim), most(items * parts * group), total(items * parts * group);
  parallel_for(pool, items * parts, [&](int64_t piece) {
    thread_local std::vector<float> scratch;
    int64_t item = piece / parts, j = piece % parts, s = item / a.kv_heads, n = item % a.kv_heads;
    int64_t first = window_start(a, s), count = a.lengths[s] - first;
    attend(a, s, n, first + count * j / parts, first + count * (j + 1) / parts, acc.data() + piece * group * a.dim,
           most.data() + piece * group, total.data() + piece * group, scratch);
  });
  parallel_for(pool, items, [&](int64_t item) {
    merge(acc.data() + item * parts * group * a.dim, most.data() + item * parts * group,
          total.data() + item * parts * group, parts, group, a.dim, a.out + item * group * a.dim);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeAttention, decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap"));
