// int8's integer dots on a CPU, as an XLA FFI handler (jaxserve/cpu_kernels/int8_dot.py builds it).
//
// XLA:CPU converts a whole int8 operand before a float dot, and its own integer dot reads Gemma 3's
// output layer at a third of the memory's speed, bound by its arithmetic (docs/quantization.md).
// This reads each int8 weight from memory once for up to four rows of a step (eight of w [K, N]):
//
//   out[r, n] = float(sum_k value[r, k] * w[k, n]) * row_scale[r] * scale[n]
//
// value is the row rounded to 15 bits as jaxserve.model.quantization.split_rows rounds it
// (|value| <= 127 * 128, row_scale = max |x_r| / (127 * 128)), so the sums are the integer dot
// of the split rows, exact in int32 over up to kChunk k's (kChunk * 127 * 16256 < 2^31) and
// added in float32 beyond. `transposed`: w is [N, K] (a tied embedding as the output layer),
// else [K, N] (the layers' matrices). w may be a stack of such matrices [L, ...] (the layers'),
// `index` picking one, so that XLA passes the stack as it is instead of copying a slice out.
// K and N are multiples of 16; the caller checks.

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

constexpr int64_t kChunk = 1024;
constexpr int64_t kAhead = 4;
constexpr int64_t kWidth = 512;  // columns of a piece of w [K, N]: eight rows' sums in 16 KiB
// w [K, N] for up to this many rows is read in runs of whole rows (`row_run`): 1.15x the speed of
// 512-column pieces for one row, even for two, slower from three (their sums for every column
// leave the L1 cache; Gemma 3's layers on an AVX2 AMD EPYC, 2 cores).
constexpr int64_t kRunRows = 2;
constexpr float kLevels = 127 * 128;

struct Dot {
  const int16_t* value;  // [R, K]
  const float* row_scale;  // [R]
  const int8_t* w;
  const float* scale;  // [N]
  float* out;  // [R, N]
  int64_t rows, k, n;
};

void round_rows(const float* x, int64_t rows, int64_t k, int16_t* value, float* row_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    float most = 0;
    for (int64_t i = 0; i < k; ++i) most = std::max(most, std::fabs(row[i]));
    float s = most / kLevels;
    s = s == 0 ? 1.0f : s;
    for (int64_t i = 0; i < k; ++i) value[r * k + i] = static_cast<int16_t>(std::nearbyint(row[i] / s));
    row_scale[r] = s;
  }
}

#if defined(__AVX2__)

int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// w [N, K]: S outputs at once, n + s * stride for s < S, each a dot of K contiguous weights with RR
// rows. Each output's weights are read in order, and the S of them are S runs far apart: with
// one, a thread's reads were one stream, which the memory served at 0.7x the speed of four
// (outputs next to each other instead, read at 60% of it).
template <int RR, int S>
void transposed_outputs(const Dot& d, int64_t r0, int64_t n, int64_t stride) {
  float sums[S][RR] = {};
  for (int64_t k0 = 0; k0 < d.k; k0 += kChunk) {
    int64_t k1 = std::min(d.k, k0 + kChunk);
    __m256i acc[S][RR];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < RR; ++r) acc[s][r] = _mm256_setzero_si256();
    for (int64_t i = k0; i < k1; i += 16) {
      __m256i x[RR];
      for (int r = 0; r < RR; ++r)
        x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.value + (r0 + r) * d.k + i));
      for (int s = 0; s < S; ++s) {
        const int8_t* at = d.w + (n + s * stride) * d.k + i;
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        for (int r = 0; r < RR; ++r) acc[s][r] = _mm256_add_epi32(acc[s][r], _mm256_madd_epi16(w, x[r]));
      }
    }
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < RR; ++r) sums[s][r] += static_cast<float>(sum_lanes(acc[s][r]));
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < RR; ++r)
      d.out[(r0 + r) * d.n + n + s * stride] = sums[s][r] * d.row_scale[r0 + r] * d.scale[n + s * stride];
}

// w [K, N]: a piece of at most kWidth columns, its sums kept in cache while k runs down the rows,
// each row's piece read as one contiguous run; each pair of k's interleaved into the 16-bit pairs
// that _mm256_madd_epi16 sums, against the row's two values broadcast.
template <int RR>
void column_rows(const Dot& d, int64_t r0, int64_t c0, int64_t c1) {
  alignas(32) int32_t acc[RR][kWidth];
  int64_t width = c1 - c0;
  for (int64_t k0 = 0; k0 < d.k; k0 += kChunk) {
    int64_t k1 = std::min(d.k, k0 + kChunk);
    std::memset(acc, 0, sizeof acc);
    for (int64_t i = k0; i < k1; i += 4) {  // two pairs of rows of w a pass: the sums read and written once
      const int8_t* row = d.w + i * d.n + c0;
      for (int64_t c = 0; c < width; c += 16) {
        if (c % 64 == 0)  // the rows kAhead passes down: each piece's run is too short for the hardware's prefetch
          for (int j = 0; j < 4; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(row + (4 * kAhead + j) * d.n + c), _MM_HINT_T0);
        __m256i lo[2], hi[2];
        for (int p = 0; p < 2; ++p) {
          const int8_t* at = row + 2 * p * d.n + c;
          __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
          __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + d.n)));
          lo[p] = _mm256_unpacklo_epi16(a, b);  // columns 0-3 and 8-11 of the 16
          hi[p] = _mm256_unpackhi_epi16(a, b);  // columns 4-7 and 12-15
        }
        for (int r = 0; r < RR; ++r) {
          __m256i x[2];  // the row's two pairs of values, each broadcast from memory (a load, no shuffle)
          for (int p = 0; p < 2; ++p)
            x[p] = _mm256_castps_si256(
                _mm256_broadcast_ss(reinterpret_cast<const float*>(d.value + (r0 + r) * d.k + i + 2 * p)));
          __m256i* sums = reinterpret_cast<__m256i*>(acc[r] + c);
          __m256i low = _mm256_add_epi32(_mm256_madd_epi16(lo[0], x[0]), _mm256_madd_epi16(lo[1], x[1]));
          __m256i high = _mm256_add_epi32(_mm256_madd_epi16(hi[0], x[0]), _mm256_madd_epi16(hi[1], x[1]));
          sums[0] = _mm256_add_epi32(sums[0], low);
          sums[1] = _mm256_add_epi32(sums[1], high);
        }
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int64_t c = 0; c < width; c += 16) {
        const __m256i* sums = reinterpret_cast<const __m256i*>(acc[r] + c);
        float* out = d.out + (r0 + r) * d.n + c0 + c;
        __m256 a = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(sums[0], sums[1], 0x20));  // columns 0-7
        __m256 b = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(sums[0], sums[1], 0x31));  // 8-15
        if (k0 > 0) {
          a = _mm256_add_ps(a, _mm256_loadu_ps(out));
          b = _mm256_add_ps(b, _mm256_loadu_ps(out + 8));
        }
        _mm256_storeu_ps(out, a);
        _mm256_storeu_ps(out + 8, b);
      }
  }
  for (int r = 0; r < RR; ++r) {
    float* out = d.out + (r0 + r) * d.n + c0;
    for (int64_t j = 0; j < width; ++j) out[j] = out[j] * d.row_scale[r0 + r] * d.scale[c0 + j];
  }
}

// w [K, N] for RR (all) rows: the rows [k0, k1) of w, read as the one contiguous stretch of memory
// they are (columns in 512-wide pieces go down the rows in 512-byte runs, which the memory serves
// slower), their int32 sums for every column in `acc` [RR][N], in the order the pairs leave them:
// columns 0-3 and 8-11 of each 16, then 4-7 and 12-15 (acc starts at zero).
template <int RR>
void row_run(const Dot& d, int64_t k0, int64_t k1, int32_t* acc) {
  for (int64_t i = k0; i < k1; i += 4) {
    const int8_t* row = d.w + i * d.n;
    __m256i x[RR][2];
    for (int r = 0; r < RR; ++r)
      for (int p = 0; p < 2; ++p)
        x[r][p] = _mm256_castps_si256(
            _mm256_broadcast_ss(reinterpret_cast<const float*>(d.value + r * d.k + i + 2 * p)));
    for (int64_t c = 0; c < d.n; c += 16) {
      __m256i lo[2], hi[2];
      for (int p = 0; p < 2; ++p) {
        const int8_t* at = row + 2 * p * d.n + c;
        __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + d.n)));
        lo[p] = _mm256_unpacklo_epi16(a, b);
        hi[p] = _mm256_unpackhi_epi16(a, b);
      }
      for (int r = 0; r < RR; ++r) {
        __m256i* sums = reinterpret_cast<__m256i*>(acc + r * d.n + c);
        __m256i low = _mm256_add_epi32(_mm256_madd_epi16(lo[0], x[r][0]), _mm256_madd_epi16(lo[1], x[r][1]));
        __m256i high = _mm256_add_epi32(_mm256_madd_epi16(hi[0], x[r][0]), _mm256_madd_epi16(hi[1], x[r][1]));
        _mm256_storeu_si256(sums, _mm256_add_epi32(_mm256_loadu_si256(sums), low));
        _mm256_storeu_si256(sums + 1, _mm256_add_epi32(_mm256_loadu_si256(sums + 1), high));
      }
    }
  }
}

// out's columns [c0, c1) from the runs' sums: each chunk's runs added in int32 (exact), the chunks in float32.
void add_runs(const Dot& d, const int32_t* acc, int64_t chunks, int64_t runs, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t c = c0; c < c1; c += 16) {
      __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
        for (int64_t j = 0; j < runs; ++j) {
          const __m256i* sums = reinterpret_cast<const __m256i*>(acc + ((chunk * runs + j) * d.rows + r) * d.n + c);
          low = _mm256_add_epi32(low, _mm256_loadu_si256(sums));
          high = _mm256_add_epi32(high, _mm256_loadu_si256(sums + 1));
        }
        a = _mm256_add_ps(a, _mm256_cvtepi32_ps(_mm256_permute2x128_si256(low, high, 0x20)));
        b = _mm256_add_ps(b, _mm256_cvtepi32_ps(_mm256_permute2x128_si256(low, high, 0x31)));
      }
      __m256 row_scale = _mm256_set1_ps(d.row_scale[r]);
      float* out = d.out + r * d.n + c;
      _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_mul_ps(a, row_scale), _mm256_loadu_ps(d.scale + c)));
      _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_mul_ps(b, row_scale), _mm256_loadu_ps(d.scale + c + 8)));
    }
}

// The piece's outputs [n0, n1) in S parts read side by side, S * RR sums in registers (four
// streams for one row, two for two; from three rows the weights are read slower than the sums).
template <int RR>
void transposed_rows(const Dot& d, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int S = RR == 1 ? 4 : RR == 2 ? 2 : 1;
  int64_t part = (n1 - n0) / S;
  for (int64_t j = 0; j < part; ++j) transposed_outputs<RR, S>(d, r0, n0 + j, part);
  for (int64_t n = n0 + S * part; n < n1; ++n) transposed_outputs<RR, 1>(d, r0, n, 0);
}

// Rows in groups, each group reading the piece's weights (from cache after the first): of four
// for w [N, K], whose sums are registers; of eight for w [K, N], whose sums are in cache.
void piece(const Dot& d, bool transposed, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < d.rows; r0 += transposed ? 4 : 8) {
    if (transposed) {
      switch (std::min<int64_t>(4, d.rows - r0)) {
        case 1: transposed_rows<1>(d, r0, n0, n1); break;
        case 2: transposed_rows<2>(d, r0, n0, n1); break;
        case 3: transposed_rows<3>(d, r0, n0, n1); break;
        default: transposed_rows<4>(d, r0, n0, n1); break;
      }
      continue;
    }
    switch (std::min<int64_t>(8, d.rows - r0)) {
      case 1: column_rows<1>(d, r0, n0, n1); break;
      case 2: column_rows<2>(d, r0, n0, n1); break;
      case 3: column_rows<3>(d, r0, n0, n1); break;
      case 4: column_rows<4>(d, r0, n0, n1); break;
      case 5: column_rows<5>(d, r0, n0, n1); break;
      case 6: column_rows<6>(d, r0, n0, n1); break;
      case 7: column_rows<7>(d, r0, n0, n1); break;
      default: column_rows<8>(d, r0, n0, n1); break;
    }
  }
}

#else  // portable loops, for CPUs without AVX2

void piece(const Dot& d, bool transposed, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      float sum = 0;
      for (int64_t k0 = 0; k0 < d.k; k0 += kChunk) {
        int32_t acc = 0;
        for (int64_t i = k0; i < std::min(d.k, k0 + kChunk); ++i)
          acc += int32_t{d.value[r * d.k + i]} * (transposed ? d.w[n * d.k + i] : d.w[i * d.n + n]);
        sum += static_cast<float>(acc);
      }
      d.out[r * d.n + n] = sum * d.row_scale[r] * d.scale[n];
    }
}

#endif

ffi::Error int8_dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> out,
                    bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || wd.size() > 3 || index.element_count() != 1)
    return ffi::Error::InvalidArgument("int8_dot: x must be a matrix, w a matrix or a stack of them, index a scalar");
  int64_t stack = wd.size() == 3 ? wd[0] : 1, layer = *index.typed_data();
  int64_t rows = xd[0], k = xd[1], n = transposed ? wd[wd.size() - 2] : wd[wd.size() - 1];
  if ((transposed ? wd[wd.size() - 1] : wd[wd.size() - 2]) != k || k % 16 || n % 16 ||
      scale.element_count() != stack * n || layer < 0 || layer >= stack)
    return ffi::Error::InvalidArgument("int8_dot: shapes do not match, K or N is not a multiple of 16, or the "
                                       "index is out of the stack");
  std::vector<int16_t> value(rows * k);
  std::vector<float> row_scale(rows);
  round_rows(x.typed_data(), rows, k, value.data(), row_scale.data());
  Dot d{value.data(), row_scale.data(), w.typed_data() + layer * k * n, scale.typed_data() + layer * n,
        out->typed_data(), rows, k, n};
  int64_t groups = n / 16, threads = std::max<int64_t>(1, pool.num_threads());
#if defined(__AVX2__)
  if (!transposed && rows <= kRunRows) {
    // A run of rows of w a thread (a chunk's rows split evenly), each with its own int32 sums
    // (zeroed by the vector); then each thread adds up a share of the columns.
    static_assert(kRunRows == 2, "row_run's instances");
    int64_t chunks = (k + kChunk - 1) / kChunk, runs = std::max<int64_t>(1, (threads + chunks - 1) / chunks);
    std::vector<int32_t> acc(chunks * runs * rows * n);
    parallel_for(pool, chunks * runs, [&](int64_t p) {
      int64_t k0 = p / runs * kChunk, j = p % runs, steps = (std::min(k, k0 + kChunk) - k0) / 16;
      (rows == 1 ? row_run<1> : row_run<2>)(d, k0 + 16 * (steps * j / runs), k0 + 16 * (steps * (j + 1) / runs),
                                            acc.data() + p * rows * n);
    });
    int64_t pieces = std::min(groups, threads);
    parallel_for(pool, pieces, [&](int64_t p) {
      add_runs(d, acc.data(), chunks, runs, 16 * (groups * p / pieces), 16 * (groups * (p + 1) / pieces));
    });
    return ffi::Error::Success();
  }
#endif
  // Pieces of whole 16-column groups, a multiple of the threads: of w [N, K] about 64 KiB of
  // weights each, of w [K, N] as wide as kWidth allows (each row's piece is one contiguous read).
  int64_t pieces = transposed ? n * k / (64 << 10) : (n + kWidth - 1) / kWidth;
  pieces = std::min(groups, (std::max(pieces, threads) + threads - 1) / threads * threads);
  parallel_for(pool, pieces, [&](int64_t p) {
    piece(d, transposed, 16 * (groups * p / pieces), 16 * (groups * (p + 1) / pieces));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Dot, int8_dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
