// Fused CPU kernels for the decode hot path (see kernels.py, which compiles this file).
//
// At batch 1 a decode step of a small model is dominated by per-op overhead, not work: an
// RMSNorm over 576 values costs ~21 us through PyTorch's composite op and attention over a
// few hundred keys ~43 us through SDPA, while the arithmetic is ~1 us. Each kernel here
// does one of those as a single loop with the same rounding as the PyTorch ops it
// replaces: float32 accumulation, one rounding to the activation dtype at the same points.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }

// Who runs a kernel's parallel loop. Called alone, a kernel forks with at::parallel_for.
// Inside DecoderStack's parallel region (one per pass, see there) every thread of the team
// calls the kernel with the same arguments and runs its own share of the items: no fork and
// join per call, and a loop too small to split (n <= grain) runs on the team's first thread.
struct Team {
  int id = 0, size = 0;  // size 0: not in a team
};
thread_local Team t_team;

template <typename F>
void for_range(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (t_team.size == 0) return at::parallel_for(begin, end, grain, f);
  const int64_t n = end - begin, chunks = std::min<int64_t>(t_team.size, std::max<int64_t>(1, (n + grain - 1) / grain));
  if (t_team.id >= chunks) return;
  const int64_t b0 = begin + n * t_team.id / chunks, b1 = begin + n * (t_team.id + 1) / chunks;
  if (b0 < b1) f(b0, b1);
}

// Dot product of n floats with a T vector, in 16 independent lanes (vectorizable without
// reassociation flags).
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * f32(b[i + l]);
  for (int w = 8; w > 0; w /= 2)  // a fixed tree: vector adds, not 16 dependent scalar ones
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  float s = lanes[0];
  for (; i < n; ++i) s += a[i] * f32(b[i]);
  return s;
}

#if defined(__AVX512F__)
// 16 bf16 -> float32 (the 16 bits moved to the top: exact)
inline __m512 load_bf16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// float32 -> bf16 bits (in the low 16 bits of each 32-bit lane), exactly as
// c10::BFloat16(float) rounds: nearest even, no flush of denormals, NaN -> 0x7FC0.
inline __m256i bf16_bits_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// The same as 8 packed bf16, and as float32 values (v rounded to bf16, exactly).
inline __m128i round_bf16_avx2(__m256 v) {
  const __m256i r = bf16_bits_avx2(v);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m256 as_bf16_avx2(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits_avx2(v), 16)); }
inline void store_bf16_avx2(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16_avx2(v));
}

inline float sum_lanes(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// 8 bf16 -> float32 (the 16 bits moved to the top: exact)
inline __m256 load_bf16_avx2(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline __m256 load8(const c10::BFloat16* p) { return load_bf16_avx2(p); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// 16 outputs' bf16 results (lo: outputs 0-7, hi: 8-15) to y, the first `valid` of them.
inline void store_bf16x16(c10::BFloat16* y, __m256 lo, __m256 hi, int64_t valid) {
  alignas(32) uint16_t tmp[16];
  uint16_t* dst = valid >= 16 ? reinterpret_cast<uint16_t*>(y) : tmp;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), round_bf16_avx2(lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8), round_bf16_avx2(hi));
  if (valid < 16) std::memcpy(y, tmp, valid * sizeof(uint16_t));
}

// 16 bf16 (the first `valid`, zeros past them) -> float32, outputs 0-7 and 8-15.
inline void load_bf16x16(const c10::BFloat16* p, int64_t valid, __m256& lo, __m256& hi) {
  alignas(32) c10::BFloat16 tmp[16] = {};
  const c10::BFloat16* src = valid >= 16 ? p : (std::memcpy(tmp, p, valid * sizeof(c10::BFloat16)), tmp);
  lo = load_bf16_avx2(src);
  hi = load_bf16_avx2(src + 8);
}

// exp(x) in float32 for softmax's shifted scores (x <= 0; below -87, where exp(x) is below
// float32's normal range, exactly 0; NaN stays NaN), within ~2 ulp: the Cephes expf
// polynomial, as exp_ps (the AVX-512 form, below), 2^n built in the exponent bits.
inline __m256 exp_ps_avx2(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_NLT_UQ);  // else 0 (-inf too)
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // (max returns its second operand, x, for NaN)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
}

#endif

// x <- x + delta (rounded to T, as `x + delta` is), h <- rms_norm(x) * w (accumulated in
// float32, rounded once to H, as F.rms_norm is). x, delta, h: (rows, n) contiguous. Without
// delta (nullptr) x is only read. w and h may be float32 where x is bf16 (the final norm,
// whose result feeds the float32 head).
template <typename T, typename W = T, typename H = W>
void add_rms_norm_impl(T* x, const T* delta, const W* w, H* h, int64_t rows, int64_t n, float eps) {
  for_range(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> xs(n);
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * n;
      const T* dr = delta ? delta + r * n : nullptr;
      H* hr = h + r * n;
      float ss = 0.f;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the same roundings, 8 at a time
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
          __m256 sum = load_bf16_avx2(xr + i);
          if (dr) {
            sum = as_bf16_avx2(_mm256_add_ps(sum, load_bf16_avx2(dr + i)));
            store_bf16_avx2(xr + i, sum);
          }
          _mm256_storeu_ps(xs.data() + i, sum);
          acc = _mm256_fmadd_ps(sum, sum, acc);
        }
        ss = sum_lanes(acc);
      }
#endif
      for (; i < n; ++i) {
        if (dr) xr[i] = static_cast<T>(f32(xr[i]) + f32(dr[i]));
        xs[i] = f32(xr[i]);
        ss += xs[i] * xs[i];
      }
      float rstd = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; i + 8 <= n; i += 8) {
          const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xs.data() + i), _mm256_set1_ps(rstd)),
                                         load8(w + i));
          if constexpr (std::is_same_v<H, float>) _mm256_storeu_ps(hr + i, y);
          else store_bf16_avx2(hr + i, y);
        }
#endif
      for (; i < n; ++i) hr[i] = static_cast<H>(xs[i] * rstd * f32(w[i]));
    }
  });
}

// In place, x (T, heads, D) strided over T and heads, D contiguous:
// x <- round(round(x * cos) + swap_halves(x) * sin), sin signed (see llama.apply_rotary).
template <typename T>
void rotary_impl(T* x, int64_t tokens, int64_t heads, int64_t d, int64_t s_tok, int64_t s_head,
                 const T* cos, const T* sin) {
  const int64_t half = d / 2;
  for_range(0, tokens * heads, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, hd = i % heads;
      T* xr = x + t * s_tok + hd * s_head;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the same roundings, 8 pairs at a time
        if (half % 8 == 0) {
          for (int64_t j = 0; j < half; j += 8) {
            const __m256 lo = load_bf16_avx2(xr + j), hi = load_bf16_avx2(xr + j + half);
            const __m256 a = as_bf16_avx2(_mm256_mul_ps(lo, load_bf16_avx2(c + j)));
            const __m256 b = as_bf16_avx2(_mm256_mul_ps(hi, load_bf16_avx2(c + j + half)));
            store_bf16_avx2(xr + j, _mm256_fmadd_ps(hi, load_bf16_avx2(s + j), a));
            store_bf16_avx2(xr + j + half, _mm256_fmadd_ps(lo, load_bf16_avx2(s + j + half), b));
          }
          continue;
        }
      }
#endif
      for (int64_t j = 0; j < d; ++j) row[j] = f32(xr[j]);
      for (int64_t j = 0; j < d; ++j) {
        const float swapped = row[j < half ? j + half : j - half];
        const float a = f32(static_cast<T>(row[j] * f32(c[j])));
        xr[j] = static_cast<T>(a + swapped * f32(s[j]));
      }
    }
  });
}

// out = round(round(silu(gate)) * up) per element, as F.silu(gate) * up rounds;
// gate_up (rows, 2n) = [gate | up] per row, out (rows, n).
template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t n) {
  for_range(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // silu(x) = x / (1 + e^-x) = x e^x / (1 + e^x)
        for (; i + 8 <= n; i += 8) {
          const __m256 x = load_bf16_avx2(g + i);
          const __m256 e = exp_ps_avx2(_mm256_min_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), x)));  // e^-|x|
          const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // x < 0: x e^x
          const __m256 a = as_bf16_avx2(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
          store_bf16_avx2(o + i, _mm256_mul_ps(a, load_bf16_avx2(u + i)));
        }
      }
#endif
      for (; i < n; ++i) {
        const float x = f32(g[i]);
        const float a = f32(static_cast<T>(x / (1.f + std::exp(-x))));
        o[i] = static_cast<T>(a * f32(u[i]));
      }
    }
  });
}

// Rows of (T, heads, D) at slots: pool[slots[t]] <- x[t] (the K/V write of a pass).
template <typename T>
void store_impl(const T* x, int64_t s_tok, int64_t s_head, T* pool, const int64_t* slots, int64_t tokens,
                int64_t heads, int64_t d) {
  for_range(0, tokens * heads, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      std::copy(x + t * s_tok + h * s_head, x + t * s_tok + h * s_head + d, pool + (slots[t] * heads + h) * d);
    }
  });
}

// Runs item(b, g, scores) for every query row b and item g < groups (a head, or a group of
// heads sharing a KV head), in parallel over all of them unless the whole attention is small
// (then on one thread); `scores` is the thread's scratch.
template <typename Item>
void for_each_query_group(int64_t rows, int64_t groups, int64_t heads, int64_t d, const int64_t* lens,
                          const Item& item) {
  int64_t work = 0;
  for (int64_t b = 0; b < rows; ++b) work += lens[b];
  const int64_t grain = work * heads * d < 65536 ? rows * groups : 1;  // small: one thread
  for_range(0, rows * groups, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) item(i / groups, i % groups, scores);
  });
}

template <typename Item>
void for_each_query_head(int64_t rows, int64_t heads, int64_t d, const int64_t* lens, const Item& item) {
  for_each_query_group(rows, heads, heads, d, lens, item);
}

// Each query i on its own: out[i, h] = softmax(q[i, h] . K[ctx] * scale) @ V[ctx] over the
// first lens[i] slots of its row's context (row_of[i]), K/V read in place from the pool
// (no gather copy). A query's result depends on nothing but its q and its keys and values.
template <typename T>
void decode_attention_impl(const T* q, int64_t q_row, int64_t q_head, const T* kp, const T* vp, const int64_t* slots,
                           const int64_t* row_of, const int64_t* lens, T* out, int64_t rows, int64_t heads,
                           int64_t kv_heads, int64_t d, int64_t ctx_stride, float scale) {
  const int64_t per_kv = heads / kv_heads;
  const int64_t slot_stride = kv_heads * d;
  for_each_query_head(rows, heads, d, lens, [&](int64_t b, int64_t h, std::vector<float>& scores) {
    std::vector<float> qv(d), acc(d);
    const int64_t kh = h / per_kv;
    const int64_t n = lens[b];
    const int64_t* sl = slots + row_of[b] * ctx_stride;
    const T* qr = q + b * q_row + h * q_head;
    for (int64_t j = 0; j < d; ++j) qv[j] = f32(qr[j]);
    scores.resize(n);
    float mx = -INFINITY;
    for (int64_t c = 0; c < n; ++c) {
      scores[c] = dot(qv.data(), kp + sl[c] * slot_stride + kh * d, d) * scale;
      mx = std::max(mx, scores[c]);
    }
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float p = std::exp(scores[c] - mx);
      total += p;
      const T* vr = vp + sl[c] * slot_stride + kh * d;
      for (int64_t j = 0; j < d; ++j) acc[j] += p * f32(vr[j]);
    }
    T* o = out + (b * heads + h) * d;
    const float inv = 1.f / total;
    for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[j] * inv);
  });
}

// --- int4 weight-only linear layer ----------------------------------------------------------
//
// Weights in groups of 32 along K: w[n, k] = q[n, k] * scale[n, g] + min[n, g], q in [0, 15],
// scale and min fp16 (a GGUF Q4_0 / Q4_1 block exactly). Outputs come in blocks of 16 (n0 ..
// n0 + 15, the last one zero-padded), in the lane layout: per 8 k (k0 .. k0 + 7) of a block,
// 64 bytes, output j's four at 4 j, byte i = q[j, k0 + i] | q[j, k0 + 4 + i] << 4:
//   q4    (N/16, K/2, 16) uint8, as (N/16, K/8, 16, 4)
//   scale, min (N/16, K/32, 16) fp16
// so each 32-bit lane of a vector load is one output's 8 codes and no shuffle is needed.
//
// The products are integers. Each token's activations are rounded, per group of 32, to
// 16-bit integers on a power-of-two grid: with e the exponent of the group's largest |x|
// (|x| < 2^e), m[k] = round(x[k] * 2^(14 - e)), |m| <= 2^14, and p = 2^(e - 14), so
// |x - m p| <= p / 2 <= 2^-14 max|x_g| (64x finer than bf16's own rounding of the largest;
// next to the 4-bit weights, nothing). Then for each token and output
//   total = bias; per group g: a = sum_k q[k] m[k] (int32, exact: |a| < 2^23),
//   total = fma(float(a), scale * p, total); total = fma(float(sum_k m[k]) * p, min, total)
// and one rounding to bf16. Integer sums are exact in any order and on any CPU, so the
// AVX-512 path (VNNI dot products of 16-bit pairs) and the portable loop agree bit for bit,
// and a token's result never depends on the other tokens of the pass: verify passes and
// plain steps compute the same numbers. A group holding inf or NaN gives p = NaN (a NaN out).
//
// Cost: the integer dot reads a byte of codes into two products with ~3 instructions per 32
// products (the float32 form needed ~7: widen, mask, shift, two conversions, two FMAs), so
// the layer streams its weights instead of waiting on arithmetic.
constexpr int64_t kInt4Block = 16, kInt4Group = 32;
// Bytes ahead to prefetch: a step's weights stream from L3 / DRAM, where one core's demand
// loads alone reach ~7 GB/s here; prefetching 2-8 KB ahead lifts a whole step's layers.
constexpr int64_t kInt4Prefetch = 8192;

struct Int4Args {
  const uint8_t* q4;
  const c10::Half* scale;
  const c10::Half* min;
  const c10::BFloat16* bias;  // (N,), or nullptr
  // The rounded activations, per token: m (K) int16, in pair order: for each 8 k (k0 .. k0+7)
  // the int16s m[k0], m[k0+2], m[k0+4], m[k0+6], m[k0+1], m[k0+3], m[k0+5], m[k0+7] (the
  // order the vector paths pair the lane layout's nibbles; the portable loop reads it too).
  const int16_t* xq;
  // Or, on the 8-bit grid (below; nullptr: the 16-bit one), m (K) int8 in k order.
  const int8_t* xq8;
  const float* step;   // (T, K / 32): p per group
  const float* msum;   // (T, K / 32): float(sum m) * p per group
  c10::BFloat16* y;    // (T, N)
  int64_t K, N, groups;
};

// The int4 kernel's order of k within each 8: pair position -> k (see Int4Args::xq).
constexpr int kPairOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

#if defined(__AVX512F__)
inline __m512 load16(const c10::BFloat16* p) { return load_bf16(p); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif

// A group of 32 activations' largest |x| and whether all are finite (the activation grids'
// first pass); with AVX2 the group also stays loaded in v, 8 lanes at a time, for the rounding.
template <typename X>
struct GroupScan {
  float big = 0.f;
  bool finite = true;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v[4];

  explicit GroupScan(const X* xg) {
    __m256 top = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int j = 0; j < 4; ++j) {
      v[j] = load8(xg + 8 * j);
      const __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[j]);
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(mag, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ));
      top = _mm256_max_ps(top, mag);
    }
    finite = _mm256_movemask_ps(ok) == 0xFF;  // no NaN, no inf
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top);
    big = *std::max_element(tops, tops + 8);
  }
#else
  explicit GroupScan(const X* xg) {
    for (int64_t k = 0; k < 32; ++k) {
      const float x = static_cast<float>(xg[k]);
      finite = finite && std::isfinite(x);
      big = std::max(big, std::fabs(x));
    }
  }
#endif
};

// 2^shift as two exact power-of-two factors, up * up2 (2^shift alone overflows float for a
// group of subnormals).
inline void pow2_factors(int shift, float& up, float& up2) {
  const int first = std::min(shift, 127);
  up = std::ldexp(1.f, first);
  up2 = std::ldexp(1.f, shift - first);
}

// Rounds x (T, K) (bf16 or float32) onto the grid above: xq (T, K), step and msum (T, K / 32).
// `pair_order`: within each 8 k the int4 kernel's pairing (kPairOrder: k0, k2, k4, k6, k1, ...);
// else k order.
// (With AVX-512 or AVX2 the same products and the same round-to-nearest-even, 16 or 8 at a time.)
template <typename X>
void round_activations(const X* x, int64_t tokens, int64_t K, bool pair_order, int16_t* xq, float* step,
                       float* msum) {
  constexpr int64_t G = 32;
  const int64_t groups = K / G;
  for (int64_t i = 0; i < tokens * groups; ++i) {
    const X* xg = x + i * G;
    int16_t* q = xq + i * G;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    const __m512 lo = load16(xg), hi = load16(xg + 16);
    const bool finite = !(_mm512_fpclass_ps_mask(lo, 0x99) | _mm512_fpclass_ps_mask(hi, 0x99));  // NaN, inf
    const float big = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#else
    const GroupScan<X> scan(xg);
    const float big = scan.big;
    const bool finite = scan.finite;
#endif
    int e = 0;
    std::frexp(finite ? big : 0.f, &e);  // big < 2^e (0 -> e = 0)
    float up, up2;  // x * 2^(14 - e) = x * up * up2, exactly
    pow2_factors(14 - e, up, up2);
    int32_t sum = 0;
    if (!finite) {
      std::fill(q, q + G, int16_t{0});
    } else {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
      // round to nearest even (MXCSR's default, as nearbyint), narrow, then the pair order
      const __m512i mlo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(lo, _mm512_set1_ps(up)), _mm512_set1_ps(up2)));
      const __m512i mhi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(hi, _mm512_set1_ps(up)), _mm512_set1_ps(up2)));
      alignas(64) static const int16_t kOrder[32] = {0,  2,  4,  6,  1,  3,  5,  7,  8,  10, 12, 14, 9,  11, 13, 15,
                                                     16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31};
      const __m512i m16 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(mlo)),
                                             _mm512_cvtepi32_epi16(mhi), 1);
      _mm512_storeu_si512(q, pair_order ? _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), m16) : m16);
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(mlo, mhi));
#elif defined(__AVX2__) && defined(__FMA__)
      // round to nearest even (MXCSR's default, as nearbyint), narrow, then the pair order
      __m256i total = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i m = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(scan.v[j], _mm256_set1_ps(up)),
                                                           _mm256_set1_ps(up2)));
        total = _mm256_add_epi32(total, m);
        const __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));  // k order
        const __m128i evens_odds = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 8 * j), pair_order ? _mm_shuffle_epi8(m16, evens_odds) : m16);
      }
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
      for (int32_t part : sums) sum += part;
#else
      for (int64_t k = 0; k < G; ++k) {
        const float v = static_cast<float>(xg[pair_order ? (k / 8) * 8 + kPairOrder[k % 8] : k]);
        const int32_t m = static_cast<int32_t>(std::nearbyint(v * up * up2));
        q[k] = static_cast<int16_t>(m);
        sum += m;
      }
#endif
    }
    step[i] = finite ? std::ldexp(1.f, e - 14) : std::numeric_limits<float>::quiet_NaN();
    msum[i] = static_cast<float>(sum) * step[i];
  }
}

// The 8-bit grid (the int4 kernel's `act_bits` = 8; GGUF's Q8_0 activations, as llama.cpp
// multiplies Q4 weights): per group of 32, with e the exponent of the largest |x| (big < 2^e)
// and norm = big 2^-e in [1/2, 1), m[k] = round(x[k] 2^-e * (127 / norm)), |m| <= 127, and
// p = (norm / 127) 2^e, so |x - m p| <= p / 2 = big / 254: 128x coarser than the 16-bit
// grid, near bf16's own rounding of the group's largest (2^-9). The products are integers
// again (exact in any order: vector and portable agree bit for bit), and cost half the
// instructions: one _mm256_maddubs_epi16 multiplies 32 code bytes by 32 activation bytes.
// The same as round_activations otherwise (inf or NaN in a group: p = NaN, m = 0).
template <typename X>
void round_activations8(const X* x, int64_t tokens, int64_t K, int8_t* xq, float* step, float* msum) {
  constexpr int64_t G = 32;
  const int64_t groups = K / G;
  for (int64_t i = 0; i < tokens * groups; ++i) {
    const X* xg = x + i * G;
    int8_t* q = xq + i * G;
    const GroupScan<X> scan(xg);
    const float big = scan.big;
    const bool finite = scan.finite;
    int e = 0;
    std::frexp(finite ? big : 0.f, &e);  // big < 2^e (0 -> e = 0)
    float up, up2;  // x * 2^-e = x * up * up2, exactly
    pow2_factors(-e, up, up2);
    const float norm = big * up * up2, inv = norm > 0.f ? 127.f / norm : 0.f;  // norm in [1/2, 1)
    int32_t sum = 0;
    if (!finite) {
      std::fill(q, q + G, int8_t{0});
    } else {
#if defined(__AVX2__) && defined(__FMA__)
      // round to nearest even (MXCSR's default, as nearbyint), narrow to bytes in k order
      __m256i total = _mm256_setzero_si256();
      for (int j = 0; j < 4; j += 2) {
        __m256i m[2];
        for (int h = 0; h < 2; ++h) {
          const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(scan.v[j + h], _mm256_set1_ps(up)),
                                                       _mm256_set1_ps(up2)), _mm256_set1_ps(inv));
          m[h] = _mm256_cvtps_epi32(s);
          total = _mm256_add_epi32(total, m[h]);
        }
        const __m128i m16a = _mm_packs_epi32(_mm256_castsi256_si128(m[0]), _mm256_extracti128_si256(m[0], 1));
        const __m128i m16b = _mm_packs_epi32(_mm256_castsi256_si128(m[1]), _mm256_extracti128_si256(m[1], 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 8 * j), _mm_packs_epi16(m16a, m16b));
      }
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
      for (int32_t part : sums) sum += part;
#else
      for (int64_t k = 0; k < G; ++k) {
        const float v = static_cast<float>(xg[k]);
        const int32_t m = static_cast<int32_t>(std::nearbyint(v * up * up2 * inv));
        q[k] = static_cast<int8_t>(m);
        sum += m;
      }
#endif
    }
    step[i] = finite ? std::ldexp(norm / 127.f, e) : std::numeric_limits<float>::quiet_NaN();
    msum[i] = static_cast<float>(sum) * step[i];
  }
}

// One call's rounded activations (a caller keeps one thread_local: the buffers are reused).
struct RoundedActivations {
  std::vector<int16_t> xq;
  std::vector<int8_t> xq8;
  std::vector<float> step, msum;

  template <typename X>
  void round(const X* x, int64_t tokens, int64_t K, bool pair_order) {
    xq.resize(tokens * K);
    step.resize(tokens * (K / 32));
    msum.resize(tokens * (K / 32));
    round_activations(x, tokens, K, pair_order, xq.data(), step.data(), msum.data());
  }

  template <typename X>
  void round8(const X* x, int64_t tokens, int64_t K) {
    xq8.resize(tokens * K);
    step.resize(tokens * (K / 32));
    msum.resize(tokens * (K / 32));
    round_activations8(x, tokens, K, xq8.data(), step.data(), msum.data());
  }
};

void int4_block_portable(const Int4Args& a, int64_t blk, int64_t tokens) {
  const int64_t n0 = blk * kInt4Block;
  const uint8_t* qb = a.q4 + blk * (a.K / 2) * kInt4Block;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < kInt4Block && n0 + j < a.N; ++j) {
      float total = a.bias ? static_cast<float>(a.bias[n0 + j]) : 0.f;
      for (int64_t g = 0; g < a.groups; ++g) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kInt4Group; ++i) {  // 8-bit grid: k order; 16-bit: pair order
          const int64_t k = g * kInt4Group + (a.xq8 ? i : (i / 8) * 8 + kPairOrder[i % 8]);
          const uint8_t byte = qb[(k / 8) * 4 * kInt4Block + 4 * j + k % 4];  // the lane layout
          const int32_t code = k % 8 < 4 ? byte & 15 : byte >> 4;
          dot += code * (a.xq8 ? a.xq8[t * a.K + k] : a.xq[t * a.K + g * kInt4Group + i]);
        }
        const int64_t s = (blk * a.groups + g) * kInt4Block + j;
        const float p = a.step[t * a.groups + g];
        total = std::fma(static_cast<float>(dot), static_cast<float>(a.scale[s]) * p, total);
        total = std::fma(a.msum[t * a.groups + g], static_cast<float>(a.min[s]), total);
      }
      a.y[t * a.N + n0 + j] = c10::BFloat16(total);
    }
}

// A block's tokens from `first` on in tiles of Max, then one tile of the rest (tile[n] runs
// n tokens).
template <typename Args>
using TileFn = void (*)(const Args&, int64_t, int64_t);

template <int Max, typename Args>
void run_tiles(const TileFn<Args> (&tile)[Max + 1], const Args& a, int64_t blk, int64_t tokens, int64_t first = 0) {
  int64_t t = first;
  for (; t + Max <= tokens; t += Max) tile[Max](a, blk, t);
  if (tokens > t) tile[tokens - t](a, blk, t);
}

#if defined(__AVX512F__)
// float32 -> bf16 bits in the low half of each lane, exactly as c10::BFloat16(float) rounds
// (nearest even, no flush of denormals, NaN -> 0x7FC0); _mm512_cvtneps_pbh flushes denormals.
inline __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(_mm512_srli_epi32(up, 16), nan, _mm512_set1_epi32(0x7FC0)));
}

// The 16 sums of 16 vectors' lanes as one vector (r[i] = sum of v[i]'s lanes), by a tree of
// shuffles and adds (~45 instructions, where 16 separate reductions take ~130).
inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of v[4i .. 4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) in float32 for softmax's shifted scores (x <= 0; below -103, where exp(x) is 0 in
// float32 or nearly, exactly 0; NaN stays NaN), within ~2 ulp:
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the Cephes expf polynomial, then 2^n.
inline __m512 exp_ps(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.f), _CMP_NLT_UQ);  // else 0 (-inf too)
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));  // (max returns x when x is NaN)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

inline void prefetch_row_l2(const c10::BFloat16* p, int64_t d) {
  for (int64_t i = 0; i < d; i += 32) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}
// The cache lines of d bf16 at p, fetched ahead.
inline void prefetch_row(const c10::BFloat16* p, int64_t d) {
  for (int64_t i = 0; i < d; i += 32) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// The weighted sum of values for P heads of one KV head at once (see the kernel below): per
// head and dimension a chain of FMAs over the even keys and one over the odd keys, put in
// order once. A 64-byte load holds 32 dimensions as 16 lanes of two bf16: the lane shifted
// left is the even dimension in float32, the lane masked the odd one (two instructions for
// 32 values, where widening 16 at a time takes four), so the sums are kept by dimension
// parity, [jj][0] even and [jj][1] odd. Each head's sums are the same operations in the same
// order whatever P is: P only shares the value loads and their widening between heads.
template <int DV, int P>
void weighted_values_avx512(const float* const* p, int64_t n, const c10::BFloat16* const* vrow, float inv[P],
                            c10::BFloat16* const* o) {
  __m512 acc[P][DV / 2][2], odd[P][DV / 2][2];
  for (int g = 0; g < P; ++g)
    for (int jj = 0; jj < DV / 2; ++jj)
      for (int e = 0; e < 2; ++e) acc[g][jj][e] = odd[g][jj][e] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto add_value = [&](__m512 (&sum)[P][DV / 2][2], int64_t c) {
    const c10::BFloat16* v = vrow[c];
    __m512 pc[P];
    for (int g = 0; g < P; ++g) pc[g] = _mm512_set1_ps(p[g][c]);
    for (int jj = 0; jj < DV / 2; ++jj) {
      const __m512i w = _mm512_loadu_si512(v + 32 * jj);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), hi = _mm512_castsi512_ps(_mm512_and_si512(w, high));
      for (int g = 0; g < P; ++g) {
        sum[g][jj][0] = _mm512_fmadd_ps(pc[g], lo, sum[g][jj][0]);
        sum[g][jj][1] = _mm512_fmadd_ps(pc[g], hi, sum[g][jj][1]);
      }
    }
  };
  int64_t c = 0;
  for (; c + 1 < n; c += 2) {
    add_value(acc, c);
    add_value(odd, c + 1);
  }
  if (c < n) add_value(acc, c);
  for (int g = 0; g < P; ++g) {
    const __m512 scale = _mm512_set1_ps(inv[g]);
    for (int jj = 0; jj < DV / 2; ++jj) {
      const __m512i even_bits = _mm512_cvtepu16_epi32(round_bf16(_mm512_mul_ps(_mm512_add_ps(acc[g][jj][0], odd[g][jj][0]), scale)));
      const __m512i odd_bits = _mm512_cvtepu16_epi32(round_bf16(_mm512_mul_ps(_mm512_add_ps(acc[g][jj][1], odd[g][jj][1]), scale)));
      _mm512_storeu_si512(o[g] + 32 * jj, _mm512_or_si512(even_bits, _mm512_slli_epi32(odd_bits, 16)));
    }
  }
}

// decode_attention_impl for bf16 with D = 16 DV (64 or 128): dot products 16 keys at a time,
// exponentials and the weighted sum of values 16 lanes at a time.
// Per query and head: scores s_c = (q . k_c) * scale, m = max s, p_c = exp(s_c - m),
// out = (sum_c p_c v_c) / (sum_c p_c), rounded once to bf16 (the same for any batch).
// One work item is one query's head, or, when there are enough items to keep every thread
// busy, the `group` heads of one query that share a KV head (grouped-query attention): each
// key's and value's address, prefetch and load (and a value's widening) then serve all of
// them. A head's arithmetic is the same either way, so the result does not depend on it.
template <int DV>
void decode_attention_bf16_avx512(const c10::BFloat16* q, int64_t q_row, int64_t q_head,
                                  const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* slots,
                                  const int64_t* row_of, const int64_t* lens, c10::BFloat16* out, int64_t rows,
                                  int64_t heads, int64_t kv_heads, int64_t ctx_stride, float scale) {
  constexpr int64_t d = 16 * DV;
  constexpr int kMaxGroup = 16;  // heads an item may hold (more per KV head: one head an item)
  const int64_t per_kv = heads / kv_heads, slot_stride = kv_heads * d;
  const int64_t threads = t_team.size ? t_team.size : at::get_num_threads();
  // Grouped only with at least two items a thread: with fewer (one query, 3 KV heads, 2
  // threads) one thread would get twice the other's work.
  const int64_t group = per_kv <= kMaxGroup && rows * kv_heads >= 2 * threads ? per_kv : 1;
  for_each_query_group(rows, heads / group, heads, d, lens, [&](int64_t b, int64_t item, std::vector<float>& scores) {
    const int64_t h0 = item * group, kh = h0 / per_kv, n = lens[b];
    const int64_t* sl = slots + row_of[b] * ctx_stride;
    const int64_t n16 = (n + 15) / 16 * 16;
    scores.assign(group * n16, -INFINITY);  // every head's of the item
    thread_local std::vector<const c10::BFloat16*> rows_at;  // each key's and value's address
    rows_at.resize(2 * n16);
    const c10::BFloat16** krow = rows_at.data();
    const c10::BFloat16** vrow = krow + n16;
    for (int64_t c = 0; c < n; ++c) {
      const int64_t at = sl[c] * slot_stride + kh * d;
      krow[c] = kp + at;
      vrow[c] = vp + at;
      if (c < 32) prefetch_row(krow[c], d);  // the first keys: the loop below fetches 32 ahead
    }
    for (int64_t c0 = 0; c0 < n; c0 += 16) {  // 16 keys at a time: 16 dot products -> one vector
      const int64_t m = std::min<int64_t>(16, n - c0);
      for (int64_t c = 0; c < m; ++c) {
        // The pools come from memory (a step's weights stream through the caches in
        // between): the keys two chunks ahead, and these keys' values for the loop below.
        if (c0 + 32 + c < n) prefetch_row_l2(krow[c0 + 32 + c], d);
        prefetch_row_l2(vrow[c0 + c], d);
      }
      for (int64_t g = 0; g < group; ++g) {
        const c10::BFloat16* qr = q + b * q_row + (h0 + g) * q_head;
#if defined(__AVX512BF16__)
        __m512bh qv[DV / 2];  // q . k as bf16 pairs: the products are exact in float32
        for (int j = 0; j < DV / 2; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qr + 32 * j);
#else
        __m512 qv[DV];
        for (int j = 0; j < DV; ++j) qv[j] = load_bf16(qr + 16 * j);
#endif
        __m512 s[16];
        for (int64_t c = 0; c < 16; ++c) {
          __m512 acc = _mm512_setzero_ps();
          if (c < m) {
            const c10::BFloat16* kr = krow[c0 + c];
#if defined(__AVX512BF16__)
            for (int j = 0; j < DV / 2; ++j) acc = _mm512_dpbf16_ps(acc, qv[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
#else
            for (int j = 0; j < DV; ++j) acc = _mm512_fmadd_ps(qv[j], load_bf16(kr + 16 * j), acc);
#endif
          }
          s[c] = acc;
        }
        _mm512_mask_storeu_ps(scores.data() + g * n16 + c0, static_cast<__mmask16>((1u << m) - 1),
                              _mm512_mul_ps(sum_lanes16(s), _mm512_set1_ps(scale)));
      }
    }
    float inv[kMaxGroup];
    const float* p[kMaxGroup];
    c10::BFloat16* o[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * n16;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < n16; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + c));
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 total = _mm512_setzero_ps();
      for (int64_t c = 0; c < n16; c += 16) {  // the padding's -inf gives 0
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + c), top));
        _mm512_storeu_ps(sg + c, e);
        total = _mm512_add_ps(total, e);
      }
      inv[g] = 1.f / _mm512_reduce_add_ps(total);
      p[g] = sg;
      o[g] = out + (b * heads + h0 + g) * d;
    }
    // values for up to 3 heads at once with 64 dimensions (24 accumulators), one with 128
    constexpr int kPer = DV == 4 ? 3 : 1;
    int64_t g = 0;
    for (; g + kPer <= group; g += kPer) weighted_values_avx512<DV, kPer>(p + g, n, vrow, inv + g, o + g);
    for (; g < group; ++g) weighted_values_avx512<DV, 1>(p + g, n, vrow, inv + g, o + g);
  });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 16 bf16 as two float32 vectors, exactly, in the order (0-3, 8-11) and (4-7, 12-15): the
// 16 bits moved to the top by in-lane interleaves with zero (no cross-lane shuffle). q, keys
// and values all use this order, and packing the two halves' bf16 bits back restores it.
inline void load_bf16x16_interleaved(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

// The sums of 8 vectors' lanes as one vector (r[i] = sum of v[i]'s lanes).
inline __m256 sum_lanes8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// decode_attention_impl for bf16 with D = 16 DV (64 or 128), as decode_attention_bf16_avx512:
// one work item is one query's head; dot products 8 keys at a time.
template <int DV>
void decode_attention_bf16_avx2(const c10::BFloat16* q, int64_t q_row, int64_t q_head,
                                const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* slots,
                                const int64_t* row_of, const int64_t* lens, c10::BFloat16* out, int64_t rows,
                                int64_t heads, int64_t kv_heads, int64_t ctx_stride, float scale) {
  constexpr int64_t d = 16 * DV;
  const int64_t per_kv = heads / kv_heads, slot_stride = kv_heads * d;
  for_each_query_head(rows, heads, d, lens, [&](int64_t b, int64_t h, std::vector<float>& scores) {
    const int64_t kh = h / per_kv, n = lens[b];
    const int64_t* sl = slots + row_of[b] * ctx_stride;
    const int64_t n8 = (n + 7) / 8 * 8;
    scores.assign(n8, -INFINITY);
    float* sg = scores.data();
    __m256 qv[2 * DV];
    for (int j = 0; j < DV; ++j) load_bf16x16_interleaved(q + b * q_row + h * q_head + 16 * j, qv[2 * j], qv[2 * j + 1]);
    for (int64_t c0 = 0; c0 < n; c0 += 8) {  // 8 keys at a time: 8 dot products -> one vector
      const int64_t m = std::min<int64_t>(8, n - c0);
      __m256 s[8];
      for (int64_t c = 0; c < 8; ++c) {
        __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
        if (c < m) {
          const c10::BFloat16* kr = kp + sl[c0 + c] * slot_stride + kh * d;
          for (int j = 0; j < DV; ++j) {
            __m256 lo, hi;
            load_bf16x16_interleaved(kr + 16 * j, lo, hi);
            acc = _mm256_fmadd_ps(qv[2 * j], lo, acc);
            acc2 = _mm256_fmadd_ps(qv[2 * j + 1], hi, acc2);
          }
        }
        s[c] = _mm256_add_ps(acc, acc2);
      }
      const __m256 sc = _mm256_mul_ps(sum_lanes8(s), _mm256_set1_ps(scale));
      if (m == 8) {
        _mm256_storeu_ps(sg + c0, sc);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sc);
        std::copy(tmp, tmp + m, sg + c0);
      }
    }
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n8; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + c));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    const __m256 top = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 total = _mm256_setzero_ps();
    for (int64_t c = 0; c < n8; c += 8) {  // the padding's -inf gives 0
      const __m256 p = exp_ps_avx2(_mm256_sub_ps(_mm256_loadu_ps(sg + c), top));
      _mm256_storeu_ps(sg + c, p);
      total = _mm256_add_ps(total, p);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum_lanes(total));
    __m256 acc[2 * DV];
    for (int j = 0; j < 2 * DV; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; ++c) {
      const c10::BFloat16* vr = vp + sl[c] * slot_stride + kh * d;
      const __m256 p = _mm256_set1_ps(sg[c]);
      for (int j = 0; j < DV; ++j) {
        __m256 lo, hi;
        load_bf16x16_interleaved(vr + 16 * j, lo, hi);
        acc[2 * j] = _mm256_fmadd_ps(p, lo, acc[2 * j]);
        acc[2 * j + 1] = _mm256_fmadd_ps(p, hi, acc[2 * j + 1]);
      }
    }
    c10::BFloat16* o = out + (b * heads + h) * d;
    for (int j = 0; j < DV; ++j) {  // bf16 bits of both halves, packed back into element order
      const __m256 lo = _mm256_mul_ps(acc[2 * j], inv), hi = _mm256_mul_ps(acc[2 * j + 1], inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j),
                          _mm256_packus_epi32(bf16_bits_avx2(lo), bf16_bits_avx2(hi)));
    }
  });
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// What the AVX-512 int4 tiles (16- and 8-bit activation grids) share: a block's output
// mask and bias, each group's integer sums into the float32 totals, the rounded store.
template <int TT>
struct Int4Totals512 {
  const Int4Args& a;
  const int64_t blk, n0, t0;
  const __mmask16 mask;
  __m512 total[TT];

  Int4Totals512(const Int4Args& args, int64_t block, int64_t first)
      : a(args), blk(block), n0(block * kInt4Block), t0(first),
        mask(a.N - n0 >= kInt4Block ? 0xFFFF : static_cast<__mmask16>((1u << (a.N - n0)) - 1)) {
    __m512 bias = _mm512_setzero_ps();
    if (a.bias) {  // bf16 -> float32: the 16 bits moved to the top
      const __m256i b16 = _mm256_maskz_loadu_epi16(mask, a.bias + n0);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16));
    }
    for (int t = 0; t < TT; ++t) total[t] = bias;
  }

  // Group g: total += float(dot) * (scale * p) + msum * min, dot token t0 + t's integer
  // sum, split over dot[t][0..NA) (independent chains: any split gives the same integers).
  template <int NA>
  void add_group(int64_t g, const __m512i (&parts)[TT][NA]) {
    __m512i dot[TT];
    for (int t = 0; t < TT; ++t) {
      dot[t] = parts[t][0];
      for (int u = 1; u < NA; ++u) dot[t] = _mm512_add_epi32(dot[t], parts[t][u]);
    }
    const int64_t s = (blk * a.groups + g) * kInt4Block;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.scale + s)));
    const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.min + s)));
    for (int t = 0; t < TT; ++t) {
      const int64_t tg = (t0 + t) * a.groups + g;
      total[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(scale, _mm512_set1_ps(a.step[tg])),
                                 total[t]);
      total[t] = _mm512_fmadd_ps(_mm512_set1_ps(a.msum[tg]), min, total[t]);
    }
  }

  void store() const {
    for (int t = 0; t < TT; ++t)
      _mm256_mask_storeu_epi16(a.y + (t0 + t) * a.N + n0, mask, round_bf16(total[t]));
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// acc + the dot products of the int16 pairs in each 32-bit lane (exact: integers).
inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// TT tokens of one block of 16 outputs (the codes unpacked once for all of them). 64 bytes
// of codes hold 8 k of the 16 outputs, lane j output j's: its low 16 bits hold the nibbles
// of k0, k4, k1, k5 and its high 16 bits those of k2, k6, k3, k7, so shifting both halves
// by 4 i and masking leaves the pairs (k0, k2), (k4, k6), (k1, k3), (k5, k7) for i = 0..3:
// the activations' pair order (kPairOrder).
template <int TT>
void int4_tile_avx512(const Int4Args& a, int64_t blk, int64_t t0) {
  Int4Totals512<TT> out(a, blk, t0);
  const uint8_t* qb = a.q4 + blk * (a.K / 2) * kInt4Block;
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  for (int64_t g = 0; g < a.groups; ++g) {
    // NA independent sums per token (a dot product's latency is ~5 cycles; one chain would
    // wait on it); integer sums, so how they are split does not change the result
    constexpr int NA = TT <= 2 ? 4 : (TT <= 4 ? 2 : 1);
    __m512i dot[TT][NA];
    for (int t = 0; t < TT; ++t)
      for (int u = 0; u < NA; ++u) dot[t][u] = _mm512_setzero_si512();
    const int32_t* xg = reinterpret_cast<const int32_t*>(a.xq + t0 * a.K + g * kInt4Group);
    const uint8_t* qg = qb + g * (kInt4Group / 2) * kInt4Block;
    for (int line = 0; line < kInt4Group / 2 * kInt4Block; line += 64)  // the codes ahead
      _mm_prefetch(reinterpret_cast<const char*>(qg + kInt4Prefetch + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m512i w = _mm512_loadu_si512(qg + chunk * 64);
      for (int i = 0; i < 4; ++i) {
        // With a sum per i (TT <= 2), nibbles 1 and 2 stay in place (16 q and 256 q, still
        // positive int16, and their sums fit int32: 8 products a group of at most
        // 3840 * 2^14 each) and are shifted back once per group: one instruction each here,
        // not two. Otherwise shift, then mask.
        const __m512i wi = i == 3 ? _mm512_srli_epi16(w, 12)
                           : NA == 4 ? _mm512_and_si512(w, _mm512_slli_epi16(nibble, 4 * i))
                                     : _mm512_and_si512(i ? _mm512_srli_epi16(w, 4 * i) : w, nibble);
        for (int t = 0; t < TT; ++t)
          dot[t][i % NA] = dot_pairs(dot[t][i % NA], wi, _mm512_set1_epi32(xg[t * a.K / 2 + chunk * 4 + i]));
      }
    }
    if (NA == 4)  // exact: those sums are multiples of 16 and 256
      for (int t = 0; t < TT; ++t) {
        dot[t][1] = _mm512_srai_epi32(dot[t][1], 4);
        dot[t][2] = _mm512_srai_epi32(dot[t][2], 8);
      }
    out.add_group(g, dot);
  }
  out.store();
}

void int4_block_avx512(const Int4Args& a, int64_t blk, int64_t tokens, int64_t first = 0) {
  static const TileFn<Int4Args> tile[9] = {nullptr, int4_tile_avx512<1>, int4_tile_avx512<2>, int4_tile_avx512<3>,
                                           int4_tile_avx512<4>, int4_tile_avx512<5>, int4_tile_avx512<6>,
                                           int4_tile_avx512<7>, int4_tile_avx512<8>};
  run_tiles<8>(tile, a, blk, tokens, first);
}
constexpr bool kInt4Avx512 = true;
#else
void int4_block_avx512(const Int4Args&, int64_t, int64_t, int64_t = 0) {}
constexpr bool kInt4Avx512 = false;
#endif

// --- Q8_0 linear layer (an LM head, float32 in and out) --------------------------------------
//
// Weights as GGUF Q8_0 blocks: w[n, k] = d[n, g] * q[n, k], q int8, d fp16, groups of 32
// along K. Outputs in blocks of 16 (the last one zero-padded):
//   q8    (N/16, K, 16) int8: q8[b, k, j] = q[16 b + j, k]
//   scale (N/16, K/32, 16) fp16
// x and y are float32. As in the int4 kernel, each token's activations are rounded per group
// of 32 onto a 16-bit grid (m, step p, |x - m p| <= p / 2 <= 2^-14 max|x_g|) and the
// products are integers: for each token and output
//   total = 0; per group g: a = sum_k q[k] m[k] (int32, exact: |a| <= 2^26),
//   total = fma(float(a), d * p, total)
// (quant.RefinedHead.q8_0_coef bounds the error: the grid, then float32 accumulation). The
// AVX-512 path (VNNI) and the portable loop agree bit for bit on any CPU, and a token's
// result never depends on the other tokens of the pass.
constexpr int64_t kQ8Block = 16, kQ8Group = 32;
constexpr int64_t kQ8Prefetch = 8192;  // bytes ahead, as for int4

struct Q8Args {
  const int8_t* q8;
  const c10::Half* scale;
  const int16_t* xq;   // (T, K): the rounded activations, in k order
  const float* step;   // (T, K / 32)
  float* y;            // (T, N)
  int64_t K, N, groups;
};

void q8_block_portable(const Q8Args& a, int64_t blk, int64_t tokens) {
  const int64_t n0 = blk * kQ8Block;
  const int8_t* qb = a.q8 + blk * a.K * kQ8Block;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < kQ8Block && n0 + j < a.N; ++j) {
      float total = 0.f;
      for (int64_t g = 0; g < a.groups; ++g) {
        const int16_t* m = a.xq + t * a.K + g * kQ8Group;
        const int8_t* qg = qb + g * kQ8Group * kQ8Block;
        int32_t dot = 0;
        for (int64_t k = 0; k < kQ8Group; ++k) dot += static_cast<int32_t>(qg[k * kQ8Block + j]) * m[k];
        const float d = static_cast<float>(a.scale[(blk * a.groups + g) * kQ8Block + j]);
        total = std::fma(static_cast<float>(dot), d * a.step[t * a.groups + g], total);
      }
      a.y[t * a.N + n0 + j] = total;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
// The same for TT tokens at once. 64 bytes of codes hold 4 k of the block's 16 outputs; a
// byte permute pairs them per output ((k0, k1) of each output, then (k2, k3)), and sign
// extension makes each 32-bit lane the int16 pair one dot_pairs step takes.
template <int TT>
void q8_tile_avx512(const Q8Args& a, int64_t blk, int64_t t0) {
  const int64_t n0 = blk * kQ8Block;
  const __mmask16 mask = a.N - n0 >= kQ8Block ? 0xFFFF : static_cast<__mmask16>((1u << (a.N - n0)) - 1);
  const int8_t* qb = a.q8 + blk * a.K * kQ8Block;
  alignas(64) static const uint8_t kPairs[64] = {
      0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
      11, 27, 12, 28, 13, 29, 14, 30, 15, 31, 32, 48, 33, 49, 34, 50, 35, 51, 36, 52, 37, 53,
      38, 54, 39, 55, 40, 56, 41, 57, 42, 58, 43, 59, 44, 60, 45, 61, 46, 62, 47, 63};
  const __m512i pairs = _mm512_load_si512(kPairs);
  constexpr int NA = TT <= 2 ? 4 : (TT <= 4 ? 2 : 1);  // independent sums (see the int4 tile)
  __m512 total[TT];
  for (int t = 0; t < TT; ++t) total[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i dot[TT][NA];
    for (int t = 0; t < TT; ++t)
      for (int u = 0; u < NA; ++u) dot[t][u] = _mm512_setzero_si512();
    const int32_t* xg = reinterpret_cast<const int32_t*>(a.xq + t0 * a.K + g * kQ8Group);
    const int8_t* qg = qb + g * kQ8Group * kQ8Block;
    for (int line = 0; line < kQ8Group * kQ8Block; line += 64)  // the codes ahead
      _mm_prefetch(reinterpret_cast<const char*>(qg + kQ8Prefetch + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < kQ8Group / 4; ++chunk) {
      const __m512i w = _mm512_permutexvar_epi8(pairs, _mm512_loadu_si512(qg + chunk * 64));
      const __m512i w01 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(w));
      const __m512i w23 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(w, 1));
      for (int t = 0; t < TT; ++t) {
        const int32_t* xt = xg + t * a.K / 2 + 2 * chunk;
        dot[t][(2 * chunk) % NA] = dot_pairs(dot[t][(2 * chunk) % NA], w01, _mm512_set1_epi32(xt[0]));
        dot[t][(2 * chunk + 1) % NA] = dot_pairs(dot[t][(2 * chunk + 1) % NA], w23, _mm512_set1_epi32(xt[1]));
      }
    }
    const __m512 scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.scale + (blk * a.groups + g) * kQ8Block)));
    for (int t = 0; t < TT; ++t) {
      for (int u = 1; u < NA; ++u) dot[t][0] = _mm512_add_epi32(dot[t][0], dot[t][u]);
      total[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][0]),
                                 _mm512_mul_ps(scale, _mm512_set1_ps(a.step[(t0 + t) * a.groups + g])), total[t]);
    }
  }
  for (int t = 0; t < TT; ++t) _mm512_mask_storeu_ps(a.y + (t0 + t) * a.N + n0, mask, total[t]);
}

void q8_block_avx512(const Q8Args& a, int64_t blk, int64_t tokens) {
  static const TileFn<Q8Args> tile[9] = {nullptr, q8_tile_avx512<1>, q8_tile_avx512<2>, q8_tile_avx512<3>,
                                         q8_tile_avx512<4>, q8_tile_avx512<5>, q8_tile_avx512<6>,
                                         q8_tile_avx512<7>, q8_tile_avx512<8>};
  run_tiles<8>(tile, a, blk, tokens);
}
constexpr bool kQ8Avx512 = true;
#else
void q8_block_avx512(const Q8Args&, int64_t, int64_t) {}
constexpr bool kQ8Avx512 = false;
#endif

// --- bf16 linear layer ----------------------------------------------------------------------
//
// Weights bf16, outputs in blocks of 16 (the last one zero-padded), k in pairs (an odd K's
// last pair zero-padded):
//   w16 (N/16, K/2, 32) bf16: w16[b, c, 2 j + e] = w[16 b + j, 2 c + e]
// so one 64-byte line holds two k of a block's 16 outputs, and a block's weights are one
// contiguous stream. For each token and output:
//   even = sum over c of w[2c] x[2c], odd = sum of w[2c + 1] x[2c + 1] (in c order, each step one
//   fused multiply-add, exact products of bf16 values), total = bias + (even + odd)
// then one rounding to bf16 (round to nearest even, as c10::BFloat16 rounds). Widening bf16
// to float32 is a shift, so the AVX-512 path does exactly the portable loop's operations
// (bit-identical); _mm512_dpbf16_ps would save the widening but flushes denormals and is not
// needed: a decode step streams its weights from memory, one 64-byte line per two FMAs a token.
constexpr int64_t kBf16Block = 16;
constexpr int64_t kBf16Prefetch = 8192;  // bytes ahead, as for int4

struct Bf16Args {
  const c10::BFloat16* w16;
  const c10::BFloat16* bias;  // (N,), or nullptr
  const float* x;      // (T, K_pad) float32 (the bf16 activations, exactly; zero past K)
  c10::BFloat16* y;    // (T, N)
  int64_t pairs, N;    // K_pad / 2
};

void bf16_block_portable(const Bf16Args& a, int64_t blk, int64_t tokens) {
  const int64_t n0 = blk * kBf16Block;
  const c10::BFloat16* wb = a.w16 + blk * a.pairs * 2 * kBf16Block;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < kBf16Block && n0 + j < a.N; ++j) {
      float even = 0.f, odd = 0.f;
      const float* xt = a.x + t * 2 * a.pairs;
      for (int64_t c = 0; c < a.pairs; ++c) {
        even = std::fma(static_cast<float>(wb[(c * kBf16Block + j) * 2]), xt[2 * c], even);
        odd = std::fma(static_cast<float>(wb[(c * kBf16Block + j) * 2 + 1]), xt[2 * c + 1], odd);
      }
      const float bias = a.bias ? static_cast<float>(a.bias[n0 + j]) : 0.f;
      a.y[t * a.N + n0 + j] = c10::BFloat16(bias + (even + odd));
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same for TT tokens at once (each weight line loaded and widened once for all of them).
template <int TT>
void bf16_tile_avx512(const Bf16Args& a, int64_t blk, int64_t t0) {
  const int64_t n0 = blk * kBf16Block;
  const __mmask16 mask = a.N - n0 >= kBf16Block ? 0xFFFF : static_cast<__mmask16>((1u << (a.N - n0)) - 1);
  const char* wb = reinterpret_cast<const char*>(a.w16 + blk * a.pairs * 2 * kBf16Block);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even[TT], odd[TT];
  for (int t = 0; t < TT; ++t) even[t] = odd[t] = _mm512_setzero_ps();
  const float* xt = a.x + t0 * 2 * a.pairs;
  for (int64_t c = 0; c < a.pairs; ++c) {
    _mm_prefetch(wb + c * 64 + kBf16Prefetch, _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(wb + c * 64);
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));      // w[2c]: the low halves
    const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(w, high));     // w[2c + 1]
    for (int t = 0; t < TT; ++t) {
      even[t] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xt[t * 2 * a.pairs + 2 * c]), even[t]);
      odd[t] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xt[t * 2 * a.pairs + 2 * c + 1]), odd[t]);
    }
  }
  __m512 bias = _mm512_setzero_ps();
  if (a.bias) {
    const __m256i b16 = _mm256_maskz_loadu_epi16(mask, a.bias + n0);
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16));
  }
  for (int t = 0; t < TT; ++t) {
    const __m512 total = _mm512_add_ps(bias, _mm512_add_ps(even[t], odd[t]));
    _mm256_mask_storeu_epi16(a.y + (t0 + t) * a.N + n0, mask, round_bf16(total));
  }
}

void bf16_block_avx512(const Bf16Args& a, int64_t blk, int64_t tokens) {
  static const TileFn<Bf16Args> tile[9] = {nullptr, bf16_tile_avx512<1>, bf16_tile_avx512<2>, bf16_tile_avx512<3>,
                                           bf16_tile_avx512<4>, bf16_tile_avx512<5>, bf16_tile_avx512<6>,
                                           bf16_tile_avx512<7>, bf16_tile_avx512<8>};
  run_tiles<8>(tile, a, blk, tokens);
}
constexpr bool kBf16Avx512 = true;
#else
void bf16_block_avx512(const Bf16Args&, int64_t, int64_t) {}
constexpr bool kBf16Avx512 = false;
#endif

// --- AVX2 paths (CPUs without AVX-512: AVX2, FMA and F16C) ------------------------------------
//
// The same arithmetic as the AVX-512 paths above, 8 lanes at a time: the int4 and Q8_0
// kernels' integer dot products (16-bit pairs, _mm256_madd_epi16: exact, so bit-identical to
// the portable loops) and the bf16 kernel's fused multiply-adds in the portable loop's
// order (bit-identical too). Only the packed layouts' in-lane shuffles differ.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The int4 tile, TT tokens of one block of 16 outputs: the AVX-512 tile's arithmetic on 32
// bytes of the lane layout at a time, w[0] outputs 0-7 and w[1] outputs 8-15 (no shuffle).
template <int TT>
void int4_tile_avx2(const Int4Args& a, int64_t blk, int64_t t0) {
  const int64_t n0 = blk * kInt4Block, valid = std::min<int64_t>(kInt4Block, a.N - n0);
  const uint8_t* qb = a.q4 + blk * (a.K / 2) * kInt4Block;
  const __m256i nibble = _mm256_set1_epi32(0x000F000F);
  __m256 bias[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  if (a.bias) load_bf16x16(a.bias + n0, valid, bias[0], bias[1]);
  __m256 total[TT][2];
  for (int t = 0; t < TT; ++t) total[t][0] = bias[0], total[t][1] = bias[1];
  // One token: a sum per nibble position, nibbles 1 and 2 left in place (see the AVX-512 tile)
  constexpr int NA = TT == 1 ? 4 : 1;
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i dot[TT][2][NA];
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h)
        for (int u = 0; u < NA; ++u) dot[t][h][u] = _mm256_setzero_si256();
    const int32_t* xg = reinterpret_cast<const int32_t*>(a.xq + t0 * a.K + g * kInt4Group);
    const uint8_t* qg = qb + g * (kInt4Group / 2) * kInt4Block;
    for (int line = 0; line < kInt4Group / 2 * kInt4Block; line += 64)  // the codes ahead
      _mm_prefetch(reinterpret_cast<const char*>(qg + kInt4Prefetch + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m256i* r = reinterpret_cast<const __m256i*>(qg + chunk * 64);
      const __m256i w[2] = {_mm256_loadu_si256(r), _mm256_loadu_si256(r + 1)};
      for (int i = 0; i < 4; ++i) {
        for (int h = 0; h < 2; ++h) {
          const __m256i wi = i == 3 ? _mm256_srli_epi16(w[h], 12)
                             : NA == 4 ? _mm256_and_si256(w[h], _mm256_slli_epi16(nibble, 4 * i))
                                       : _mm256_and_si256(i ? _mm256_srli_epi16(w[h], 4 * i) : w[h], nibble);
          for (int t = 0; t < TT; ++t)
            dot[t][h][i % NA] = _mm256_add_epi32(
                dot[t][h][i % NA], _mm256_madd_epi16(wi, _mm256_set1_epi32(xg[t * a.K / 2 + chunk * 4 + i])));
        }
      }
    }
    const int64_t s = (blk * a.groups + g) * kInt4Block;
    const __m256 scale[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + s))),
                             _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + s + 8)))};
    const __m256 min[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.min + s))),
                           _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.min + s + 8)))};
    for (int t = 0; t < TT; ++t) {
      const int64_t tg = (t0 + t) * a.groups + g;
      for (int h = 0; h < 2; ++h) {
        __m256i d = dot[t][h][0];
        if (NA == 4)  // exact: those sums are multiples of 16 and 256
          d = _mm256_add_epi32(_mm256_add_epi32(d, dot[t][h][NA - 1]),
                               _mm256_add_epi32(_mm256_srai_epi32(dot[t][h][1 % NA], 4),
                                                _mm256_srai_epi32(dot[t][h][2 % NA], 8)));
        total[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(scale[h], _mm256_set1_ps(a.step[tg])),
                                      total[t][h]);
        total[t][h] = _mm256_fmadd_ps(_mm256_set1_ps(a.msum[tg]), min[h], total[t][h]);
      }
    }
  }
  for (int t = 0; t < TT; ++t) store_bf16x16(a.y + (t0 + t) * a.N + n0, total[t][0], total[t][1], valid);
}

void int4_block_avx2(const Int4Args& a, int64_t blk, int64_t tokens) {
  static const TileFn<Int4Args> tile[5] = {nullptr, int4_tile_avx2<1>, int4_tile_avx2<2>, int4_tile_avx2<3>,
                                           int4_tile_avx2<4>};
  run_tiles<4>(tile, a, blk, tokens);
}
constexpr bool kInt4Avx2 = true;

// The Q8_0 tile: two rows (k, k + 1) of the block's 16 outputs byte-interleaved and sign
// extended are 16 int16 pairs (q[j, k], q[j, k + 1]), outputs 0-7 and 8-15, in k order.
template <int TT>
void q8_tile_avx2(const Q8Args& a, int64_t blk, int64_t t0) {
  const int64_t n0 = blk * kQ8Block, valid = std::min<int64_t>(kQ8Block, a.N - n0);
  const int8_t* qb = a.q8 + blk * a.K * kQ8Block;
  __m256 total[TT][2];
  for (int t = 0; t < TT; ++t) total[t][0] = total[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i dot[TT][2];
    for (int t = 0; t < TT; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
    const int32_t* xg = reinterpret_cast<const int32_t*>(a.xq + t0 * a.K + g * kQ8Group);
    const int8_t* qg = qb + g * kQ8Group * kQ8Block;
    for (int line = 0; line < kQ8Group * kQ8Block; line += 64)  // the codes ahead
      _mm_prefetch(reinterpret_cast<const char*>(qg + kQ8Prefetch + line), _MM_HINT_T0);
    for (int pair = 0; pair < kQ8Group / 2; ++pair) {
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 2 * pair * kQ8Block));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + (2 * pair + 1) * kQ8Block));
      const __m256i w[2] = {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1))};
      for (int t = 0; t < TT; ++t) {
        const __m256i x = _mm256_set1_epi32(xg[t * a.K / 2 + pair]);
        for (int h = 0; h < 2; ++h) dot[t][h] = _mm256_add_epi32(dot[t][h], _mm256_madd_epi16(w[h], x));
      }
    }
    const __m256i sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.scale + (blk * a.groups + g) * kQ8Block));
    const __m256 scale[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(sc)), _mm256_cvtph_ps(_mm256_extracti128_si256(sc, 1))};
    for (int t = 0; t < TT; ++t) {
      const __m256 p = _mm256_set1_ps(a.step[(t0 + t) * a.groups + g]);
      for (int h = 0; h < 2; ++h)
        total[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]), _mm256_mul_ps(scale[h], p), total[t][h]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    float* y = a.y + (t0 + t) * a.N + n0;
    alignas(32) float tmp[16];
    float* dst = valid >= 16 ? y : tmp;
    _mm256_storeu_ps(dst, total[t][0]);
    _mm256_storeu_ps(dst + 8, total[t][1]);
    if (valid < 16) std::memcpy(y, tmp, valid * sizeof(float));
  }
}

void q8_block_avx2(const Q8Args& a, int64_t blk, int64_t tokens) {
  static const TileFn<Q8Args> tile[5] = {nullptr, q8_tile_avx2<1>, q8_tile_avx2<2>, q8_tile_avx2<3>, q8_tile_avx2<4>};
  run_tiles<4>(tile, a, blk, tokens);
}
constexpr bool kQ8Avx2 = true;

// The bf16 tile: a 64-byte line (two k of 16 outputs) as two halves of 8 outputs; the
// portable loop's even and odd sums, one fused multiply-add per weight, in its order.
template <int TT>
void bf16_tile_avx2(const Bf16Args& a, int64_t blk, int64_t t0) {
  const int64_t n0 = blk * kBf16Block, valid = std::min<int64_t>(kBf16Block, a.N - n0);
  const char* wb = reinterpret_cast<const char*>(a.w16 + blk * a.pairs * 2 * kBf16Block);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 even[TT][2], odd[TT][2];
  for (int t = 0; t < TT; ++t)
    for (int h = 0; h < 2; ++h) even[t][h] = odd[t][h] = _mm256_setzero_ps();
  const float* xt = a.x + t0 * 2 * a.pairs;
  for (int64_t c = 0; c < a.pairs; ++c) {
    _mm_prefetch(wb + c * 64 + kBf16Prefetch, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64 + 32 * h));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));   // w[2c]: the low halves
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(w, high));  // w[2c + 1]
      for (int t = 0; t < TT; ++t) {
        even[t][h] = _mm256_fmadd_ps(w0, _mm256_set1_ps(xt[t * 2 * a.pairs + 2 * c]), even[t][h]);
        odd[t][h] = _mm256_fmadd_ps(w1, _mm256_set1_ps(xt[t * 2 * a.pairs + 2 * c + 1]), odd[t][h]);
      }
    }
  }
  __m256 bias[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  if (a.bias) load_bf16x16(a.bias + n0, valid, bias[0], bias[1]);
  for (int t = 0; t < TT; ++t)
    store_bf16x16(a.y + (t0 + t) * a.N + n0, _mm256_add_ps(bias[0], _mm256_add_ps(even[t][0], odd[t][0])),
                  _mm256_add_ps(bias[1], _mm256_add_ps(even[t][1], odd[t][1])), valid);
}

void bf16_block_avx2(const Bf16Args& a, int64_t blk, int64_t tokens) {
  static const TileFn<Bf16Args> tile[4] = {nullptr, bf16_tile_avx2<1>, bf16_tile_avx2<2>, bf16_tile_avx2<3>};
  run_tiles<3>(tile, a, blk, tokens);
}
constexpr bool kBf16Avx2 = true;
#else
void int4_block_avx2(const Int4Args&, int64_t, int64_t) {}
void q8_block_avx2(const Q8Args&, int64_t, int64_t) {}
void bf16_block_avx2(const Bf16Args&, int64_t, int64_t) {}
constexpr bool kInt4Avx2 = false, kQ8Avx2 = false, kBf16Avx2 = false;
#endif

// --- the int4 kernel on the 8-bit activation grid (AVX2, AVX-512) ---------------------------
//
// The same lane layout (above): each 32-bit lane of a 32-byte load is one output's 8 codes,
// the low nibbles q[k0..k3], the high ones q[k4..k7], and one _mm256_maddubs_epi16 (unsigned
// codes times signed activations, in k order) sums them in pairs: 32 products an
// instruction, where the 16-bit grid's _mm256_madd_epi16 makes 16. The pairs (|sum| <= 2 *
// 15 * 127) add up in 16 bits over a group's 8 (|total| <= 30480: no saturation, exact),
// then one _mm256_madd_epi16 by ones widens them to an int32 per output.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <int TT>
void int4_tile8_avx2(const Int4Args& a, int64_t blk, int64_t t0) {
  const int64_t n0 = blk * kInt4Block, valid = std::min<int64_t>(kInt4Block, a.N - n0);
  const uint8_t* qb = a.q4 + blk * (a.K / 2) * kInt4Block;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 bias[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  if (a.bias) load_bf16x16(a.bias + n0, valid, bias[0], bias[1]);
  __m256 total[TT][2];
  for (int t = 0; t < TT; ++t) total[t][0] = bias[0], total[t][1] = bias[1];
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i acc[TT][2];
    for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    const int32_t* xg = reinterpret_cast<const int32_t*>(a.xq8 + t0 * a.K + g * kInt4Group);
    const uint8_t* qg = qb + g * (kInt4Group / 2) * kInt4Block;
    for (int line = 0; line < kInt4Group / 2 * kInt4Block; line += 64)  // the codes ahead
      _mm_prefetch(reinterpret_cast<const char*>(qg + kInt4Prefetch + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; ++chunk) {
      for (int h = 0; h < 2; ++h) {  // outputs 0-7, 8-15
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + chunk * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int t = 0; t < TT; ++t) {
          const int32_t* xt = xg + t * a.K / 4 + chunk * 2;
          acc[t][h] = _mm256_add_epi16(acc[t][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xt[0])));
          acc[t][h] = _mm256_add_epi16(acc[t][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xt[1])));
        }
      }
    }
    const int64_t s = (blk * a.groups + g) * kInt4Block;
    const __m256 scale[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + s))),
                             _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + s + 8)))};
    const __m256 min[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.min + s))),
                           _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.min + s + 8)))};
    for (int t = 0; t < TT; ++t) {
      const int64_t tg = (t0 + t) * a.groups + g;
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_madd_epi16(acc[t][h], ones);
        total[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(scale[h], _mm256_set1_ps(a.step[tg])),
                                      total[t][h]);
        total[t][h] = _mm256_fmadd_ps(_mm256_set1_ps(a.msum[tg]), min[h], total[t][h]);
      }
    }
  }
  for (int t = 0; t < TT; ++t) store_bf16x16(a.y + (t0 + t) * a.N + n0, total[t][0], total[t][1], valid);
}

void int4_block8_avx2(const Int4Args& a, int64_t blk, int64_t tokens) {
  static const TileFn<Int4Args> tile[5] = {nullptr, int4_tile8_avx2<1>, int4_tile8_avx2<2>, int4_tile8_avx2<3>,
                                           int4_tile8_avx2<4>};
  run_tiles<4>(tile, a, blk, tokens);
}
constexpr bool kInt4Act8Avx2 = true;
#else
void int4_block8_avx2(const Int4Args&, int64_t, int64_t) {}
constexpr bool kInt4Act8Avx2 = false;
#endif

// The same on AVX-512: a 64-byte load is all 16 outputs' 8 codes (no halves), and with VNNI
// one _mm512_dpbusd_epi32 multiplies 64 code bytes by 64 activation bytes and adds each
// lane's 4 products to its int32 sum (exact), replacing the AVX2 tile's maddubs, 16-bit add
// and final widening. Without VNNI, maddubs then madd by ones: the same integers.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i dot_quads(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}

template <int TT>
void int4_tile8_avx512(const Int4Args& a, int64_t blk, int64_t t0) {
  Int4Totals512<TT> out(a, blk, t0);
  const uint8_t* qb = a.q4 + blk * (a.K / 2) * kInt4Block;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < a.groups; ++g) {
    // NA independent sums per token (a dot product waits ~5 cycles on the one before it)
    constexpr int NA = TT == 1 ? 4 : (TT <= 3 ? 2 : 1);
    __m512i dot[TT][NA];
    for (int t = 0; t < TT; ++t)
      for (int u = 0; u < NA; ++u) dot[t][u] = _mm512_setzero_si512();
    const int32_t* xg = reinterpret_cast<const int32_t*>(a.xq8 + t0 * a.K + g * kInt4Group);
    const uint8_t* qg = qb + g * (kInt4Group / 2) * kInt4Block;
    for (int line = 0; line < kInt4Group / 2 * kInt4Block; line += 64)  // the codes ahead
      _mm_prefetch(reinterpret_cast<const char*>(qg + kInt4Prefetch + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m512i w = _mm512_loadu_si512(qg + chunk * 64);
      const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      for (int t = 0; t < TT; ++t) {
        const int32_t* xt = xg + t * a.K / 4 + chunk * 2;
        dot[t][(2 * chunk) % NA] = dot_quads(dot[t][(2 * chunk) % NA], lo, _mm512_set1_epi32(xt[0]));
        dot[t][(2 * chunk + 1) % NA] = dot_quads(dot[t][(2 * chunk + 1) % NA], hi, _mm512_set1_epi32(xt[1]));
      }
    }
    out.add_group(g, dot);
  }
  out.store();
}

void int4_block8_avx512(const Int4Args& a, int64_t blk, int64_t tokens, int64_t first = 0) {
  static const TileFn<Int4Args> tile[9] = {nullptr, int4_tile8_avx512<1>, int4_tile8_avx512<2>, int4_tile8_avx512<3>,
                                           int4_tile8_avx512<4>, int4_tile8_avx512<5>, int4_tile8_avx512<6>,
                                           int4_tile8_avx512<7>, int4_tile8_avx512<8>};
  run_tiles<8>(tile, a, blk, tokens, first);
}
constexpr bool kInt4Act8Avx512 = true;
#else
void int4_block8_avx512(const Int4Args&, int64_t, int64_t, int64_t = 0) {}
constexpr bool kInt4Act8Avx512 = false;
#endif

// --- int4 linear on AMX tiles (the 16-bit activation grid) ----------------------------------
//
// Passes of 32 tokens or more (kAmxMinTokens), on CPUs with AMX-INT8 (Intel Sapphire Rapids
// on), in tiles of 16 tokens: the same
// integer sums as the AVX-512 tiles, from tile dot products instead of VNNI ones. One tile
// instruction multiplies 16 tokens' 32 activation bytes by 16 outputs' 32 codes: a group's
// 16 x 16 dot products at once, where the AVX-512 tile spends a VNNI instruction and a
// broadcast per token and 2 k. Per group and block of 16 outputs:
//   B (tmm4): the codes as unsigned bytes, 8 rows of 64 (amx_codes);
//   A (tmm2, tmm3): the activations, 16 tokens x 32 k bytes read in place with the row
//     stride K, as two planes: m = 256 hi + lo, hi = m >> 8 (signed, |hi| <= 64 since
//     |m| <= 2^14) and lo = m & 255 (unsigned);
//   C (tmm0, tmm1) = A . B in int32 (TDPBSUD: signed by unsigned; TDPBUUD: unsigned by
//     unsigned), exact (|256 C_hi| < 2^23, C_lo < 2^17), and dot = 256 C_hi + C_lo: the
//     integers the AVX-512 tile sums (any order of integer sums gives them).
// Those go through Int4Totals512's add_group as the AVX-512 tiles' do (the same float32
// operations in the same order), so every output is the same bit for bit, on any split of a
// pass into tiles: a token's result still never depends on the others of its pass. A
// pass's last tokens that fill no tile of 16 run on the AVX-512 tiles.
// Measured (Intel Xeon VM, 2 threads, bench/experiments/linear_widths.py): the default model's body
// 1.1x faster at 16 tokens, 1.2-1.35x at 32-64, 1.15x at 512. What bounds it is not the
// tile products but the per-group float epilogue (four vector operations a token, as on
// AVX-512) and reading each group's sums back from the tiles. The 8-bit grid gains nothing
// here (its VNNI form already multiplies 4 bytes a lane) and keeps its AVX-512 tiles.

// Whether wide passes may use the tiles (set_int4_amx: benchmarks and tests compare the paths).
std::atomic<bool> g_int4_amx{true};
// The narrowest pass that runs on them. Not 16, one tile: with a 16-token pass on tiles and a
// 15-token one on AVX-512, a 16-row plain step got ~10% cheaper while every drafted token at
// 16 rows (an AVX-512 tail) cost what it did: a step in the cost of a pass at 16 tokens, which
// the adaptive controller's bounds (cost convex in tokens) do not model. Plain engines at 16
// in flight ran 3-4% faster, adaptive ones not (0.99x with and without the tiles, chat), so
// adaptive's ratio to plain fell by that. From 32 tokens on (prefill chunks, wide verify
// passes) 16-row decode steps run as before and prefill gains (docs/benchmarks.md).
constexpr int64_t kAmxMinTokens = 32;

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kAmxTokens = 16;  // a tile's rows: tokens per tile pass

// Linux grants a process AMX's tile data only on request (5.16 on); asked once, before any
// tile instruction. False (an older kernel, or a VM without it): the AVX-512 tiles run.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Tiles of this thread (tile state is per thread): tmm0, tmm1 the int32 sums (16 tokens x 16
// outputs), tmm2, tmm3 the activation bytes (16 tokens x 32 k), tmm4 the codes (8 x 64).
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure() {
  AmxConfig c;
  for (int i = 0; i < 4; ++i) {
    c.rows[i] = kAmxTokens;
    c.colsb[i] = i < 2 ? 64 : 32;
  }
  c.rows[4] = 8;
  c.colsb[4] = 64;
  _tile_loadconfig(&c);
}

// The 16-bit grid's m (pair order, as rounded for the AVX-512 tiles) as the two byte planes
// above, in k order; n a multiple of 32.
void split_activations(const int16_t* xq, int64_t n, int8_t* hi, uint8_t* lo) {
  alignas(64) static const int16_t kUnpair[32] = {0,  4,  1,  5,  2,  6,  3,  7,  8,  12, 9,  13, 10, 14, 11, 15,
                                                  16, 20, 17, 21, 18, 22, 19, 23, 24, 28, 25, 29, 26, 30, 27, 31};
  const __m512i unpair = _mm512_load_si512(kUnpair), byte = _mm512_set1_epi16(0xFF);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512i m = _mm512_permutexvar_epi16(unpair, _mm512_loadu_si512(xq + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(m, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_cvtepi16_epi8(_mm512_and_si512(m, byte)));
  }
}

// One block's codes as B tiles, every group's (groups x 512 bytes): row r of a group's tile
// holds each output's 4 codes of k = 4 r .. 4 r + 3; the lane layout's chunk c (k 8c .. 8c + 7)
// is rows 2c (its low nibbles) and 2c + 1 (its high ones), two masks and no shuffle. Built
// before the tiles read it (a tile load right behind the vector stores that wrote its bytes
// waits for them).
void amx_codes(const Int4Args& a, int64_t blk, uint8_t* codes) {
  const uint8_t* qb = a.q4 + blk * (a.K / 2) * kInt4Block;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t i = 0; i < a.groups * 4; ++i) {  // 4 chunks of 64 bytes a group
    const __m512i w = _mm512_loadu_si512(qb + 64 * i);
    _mm512_store_si512(codes + 128 * i, _mm512_and_si512(w, low));
    _mm512_store_si512(codes + 128 * i + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
  }
}

// 16 tokens from t0 of one block of 16 outputs, its B tiles in `codes` (amx_codes), the
// activations' byte planes `hi` and `lo` (T, K). Needs amx_configure() on this thread.
// Software-pipelined: group g + 1's tiles are issued before group g's sums are read back
// (two buffers), so the wait for a tile store to reach the vector loads overlaps work.
void int4_tile_amx(const Int4Args& a, const uint8_t* codes, const int8_t* hi, const uint8_t* lo, int64_t blk,
                   int64_t t0) {
  Int4Totals512<kAmxTokens> out(a, blk, t0);
  alignas(64) int32_t sums[2][2][kAmxTokens * 16];
  auto tiles = [&](int64_t g) {  // group g's integer sums (high and low plane) into sums[g % 2]
    const int64_t at = t0 * a.K + g * kInt4Group;
    _tile_loadd(4, codes + 512 * g, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, hi + at, a.K);
    _tile_loadd(3, lo + at, a.K);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbuud(1, 3, 4);
    _tile_stored(0, sums[g % 2][0], 64);
    _tile_stored(1, sums[g % 2][1], 64);
  };
  tiles(0);
  for (int64_t g = 0; g < a.groups; ++g) {
    if (g + 1 < a.groups) tiles(g + 1);
    const int32_t(&s)[2][kAmxTokens * 16] = sums[g % 2];
    __m512i dot[kAmxTokens][1];
    for (int t = 0; t < kAmxTokens; ++t)
      dot[t][0] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(s[0] + 16 * t), 8),
                                   _mm512_load_si512(s[1] + 16 * t));
    out.add_group(g, dot);
  }
  out.store();
}

// A block's tokens in AMX tiles of 16, the rest on the AVX-512 tiles.
void int4_block_amx(const Int4Args& a, const int8_t* hi, const uint8_t* lo, int64_t blk, int64_t tokens) {
  thread_local std::vector<__m512i> buffer;  // (64-byte aligned: 8 vectors a group)
  buffer.resize(a.groups * 8);
  uint8_t* codes = reinterpret_cast<uint8_t*>(buffer.data());
  amx_codes(a, blk, codes);
  int64_t t = 0;
  for (; t + kAmxTokens <= tokens; t += kAmxTokens) int4_tile_amx(a, codes, hi, lo, blk, t);
  if (t < tokens) int4_block_avx512(a, blk, tokens, t);
}
constexpr bool kInt4Amx = true;
#else
bool amx_permitted() { return false; }
void amx_configure() {}
void split_activations(const int16_t*, int64_t, int8_t*, uint8_t*) {}
void int4_block_amx(const Int4Args&, const int8_t*, const uint8_t*, int64_t, int64_t) {}
constexpr bool kInt4Amx = false;
#endif

// The vector path each kernel has on this CPU (AVX-512, else AVX2), if any.
constexpr bool kInt4Vector = kInt4Avx512 || kInt4Avx2, kInt4Act8Vector = kInt4Act8Avx512 || kInt4Act8Avx2,
               kQ8Vector = kQ8Avx512 || kQ8Avx2, kBf16Vector = kBf16Avx512 || kBf16Avx2;
constexpr const char* kIsa = kInt4Avx512 ? "avx512" : (kInt4Avx2 ? "avx2" : "portable");

void int4_block_vector(const Int4Args& a, int64_t blk, int64_t tokens) {
  if (a.xq8 && kInt4Act8Avx512) int4_block8_avx512(a, blk, tokens);
  else if (a.xq8) int4_block8_avx2(a, blk, tokens);
  else if (kInt4Avx512) int4_block_avx512(a, blk, tokens);
  else int4_block_avx2(a, blk, tokens);
}
void q8_block_vector(const Q8Args& a, int64_t blk, int64_t tokens) {
  if (kQ8Avx512) q8_block_avx512(a, blk, tokens);
  else q8_block_avx2(a, blk, tokens);
}
void bf16_block_vector(const Bf16Args& a, int64_t blk, int64_t tokens) {
  if (kBf16Avx512) bf16_block_avx512(a, blk, tokens);
  else bf16_block_avx2(a, blk, tokens);
}

// decode_attention's work on checked arguments: the vector path for bf16 with D = 64 or 128.
template <typename T>
void attention_run(const T* q, int64_t q_row, int64_t q_head, const T* kp, const T* vp, const int64_t* slots,
                   const int64_t* row_of, const int64_t* lens, T* out, int64_t rows, int64_t heads,
                   int64_t kv_heads, int64_t d, int64_t ctx_stride, float scale) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (d == 64 || d == 128) {
#if defined(__AVX512F__)
      auto run = d == 64 ? decode_attention_bf16_avx512<4> : decode_attention_bf16_avx512<8>;
#else
      auto run = d == 64 ? decode_attention_bf16_avx2<4> : decode_attention_bf16_avx2<8>;
#endif
      return run(q, q_row, q_head, kp, vp, slots, row_of, lens, out, rows, heads, kv_heads, ctx_stride, scale);
    }
  }
#endif
  decode_attention_impl<T>(q, q_row, q_head, kp, vp, slots, row_of, lens, out, rows, heads, kv_heads, d, ctx_stride,
                           scale);
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "verispec kernels: ", what); }

// The attention kernel's indices checked for n queries over pools of S slots: slots (R, C),
// row_of and lens (n,) contiguous int64; each query's row in range, 1..C keys, every slot it
// reads in [0, S).
void check_context(const at::Tensor& slots, const at::Tensor& row_of, const at::Tensor& lens, int64_t n, int64_t S) {
  check(slots.dim() == 2 && slots.is_contiguous() && slots.scalar_type() == at::kLong,
        "slots must be contiguous int64 (R, C)");
  check(lens.is_contiguous() && lens.scalar_type() == at::kLong && lens.numel() == n &&
        row_of.is_contiguous() && row_of.scalar_type() == at::kLong && row_of.numel() == n,
        "row_of and lens must be contiguous int64 (N,)");
  const int64_t C = slots.size(1);
  const int64_t *sp = slots.data_ptr<int64_t>(), *rp = row_of.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    check(rp[i] >= 0 && rp[i] < slots.size(0), "row_of out of range");
    check(lp[i] >= 1 && lp[i] <= C, "each query needs 1..C context slots");
    for (int64_t c = 0; c < lp[i]; ++c)
      check(sp[rp[i] * C + c] >= 0 && sp[rp[i] * C + c] < S, "slot out of range");
  }
}

// A linear's optional bias checked: bf16 (N,); its data, or nullptr for none.
const c10::BFloat16* bias_checked(const c10::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check(bias->dim() == 1 && bias->is_contiguous() && bias->numel() == out_features &&
        bias->scalar_type() == at::kBFloat16, "bias must be contiguous bf16 (N,)");
  return bias->data_ptr<c10::BFloat16>();
}

// int4_linear's weight arguments checked for inputs of K features; returns the bias's data.
const c10::BFloat16* int4_checked(int64_t K, const at::Tensor& q4, const at::Tensor& scale, const at::Tensor& min,
                                  int64_t out_features, const c10::optional<at::Tensor>& bias, int64_t act_bits) {
  check(act_bits == 16 || act_bits == 8, "act_bits must be 16 or 8");
  const int64_t blocks = q4.size(0);
  check(K % kInt4Group == 0 && q4.dim() == 3 && q4.is_contiguous() && q4.scalar_type() == at::kByte &&
        q4.size(1) == K / 2 && q4.size(2) == kInt4Block, "q4 must be contiguous uint8 (N/16, K/2, 16)");
  check(out_features > (blocks - 1) * kInt4Block && out_features <= blocks * kInt4Block, "out_features must fit q4's blocks");
  for (const at::Tensor* s : {&scale, &min})
    check(s->is_contiguous() && s->scalar_type() == at::kHalf && s->dim() == 3 && s->size(0) == blocks &&
          s->size(1) == K / kInt4Group && s->size(2) == kInt4Block, "scale and min must be contiguous fp16 (N/16, K/32, 16)");
  return bias_checked(bias, out_features);
}

// y (T, N) = x (T, K) @ W.T + bias on checked arguments: x rounded into this thread's
// buffers, then the output blocks through for_range.
void int4_run(const c10::BFloat16* x, int64_t tokens, const at::Tensor& q4, const at::Tensor& scale,
              const at::Tensor& min, int64_t out_features, const c10::BFloat16* bias, bool portable, int64_t act_bits,
              c10::BFloat16* y) {
  const int64_t K = q4.size(1) * 2, blocks = q4.size(0), groups = K / kInt4Group;
  thread_local RoundedActivations r;
  const bool act8 = act_bits == 8;
  if (act8) r.round8(x, tokens, K);
  else r.round(x, tokens, K, true);
  const Int4Args args{q4.data_ptr<uint8_t>(), scale.data_ptr<c10::Half>(), min.data_ptr<c10::Half>(), bias,
                      act8 ? nullptr : r.xq.data(), act8 ? r.xq8.data() : nullptr, r.step.data(), r.msum.data(), y,
                      K, out_features, groups};
  const bool vector = (act8 ? kInt4Act8Vector : kInt4Vector) && !portable;
  // AMX tiles for passes of 32 tokens or more, in tiles of 16 (see "int4 linear on AMX tiles")
  const bool amx = vector && !act8 && kInt4Amx && tokens >= kAmxMinTokens &&
                   g_int4_amx.load(std::memory_order_relaxed) && amx_permitted();
  thread_local std::vector<int8_t> hi;
  thread_local std::vector<uint8_t> lo;
  if (amx) {
    hi.resize(tokens * K);
    lo.resize(tokens * K);
    split_activations(r.xq.data(), tokens * K, hi.data(), lo.data());
  }
  // (this thread's buffers: inside the loop `hi` would name the worker thread's own)
  const int8_t* planes_hi = hi.data();
  const uint8_t* planes_lo = lo.data();
  for_range(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    if (amx) amx_configure();  // (tile state is per thread: each chunk configures its own)
    for (int64_t b = b0; b < b1; ++b) {
      if (amx) int4_block_amx(args, planes_hi, planes_lo, b, tokens);
      else if (vector) int4_block_vector(args, b, tokens);
      else int4_block_portable(args, b, tokens);
    }
#if defined(__AMX_TILE__)
    if (amx) _tile_release();  // (other code on this thread, oneDNN's, configures its own)
#endif
  });
}

// bf16_linear's weight arguments checked for inputs of K features; returns the bias's data.
const c10::BFloat16* bf16_checked(int64_t K, const at::Tensor& w16, int64_t out_features,
                                  const c10::optional<at::Tensor>& bias) {
  const int64_t blocks = w16.size(0), pairs = (K + 1) / 2;
  check(w16.dim() == 3 && w16.is_contiguous() && w16.scalar_type() == at::kBFloat16 && w16.size(1) == pairs &&
        w16.size(2) == 2 * kBf16Block, "w16 must be contiguous bf16 (N/16, ceil(K/2), 32)");
  check(out_features > (blocks - 1) * kBf16Block && out_features <= blocks * kBf16Block,
        "out_features must fit w16's blocks");
  return bias_checked(bias, out_features);
}

// y (T, N) = x (T, K) @ W.T + bias on checked arguments: x widened into this thread's
// buffer, then the output blocks through for_range.
void bf16_run(const c10::BFloat16* x, int64_t tokens, int64_t K, const at::Tensor& w16, int64_t out_features,
              const c10::BFloat16* bias, bool portable, c10::BFloat16* y) {
  const int64_t blocks = w16.size(0), pairs = (K + 1) / 2;
  thread_local std::vector<float> xf;  // x in float32, rows padded to whole pairs (reused across calls)
  xf.assign(tokens * 2 * pairs, 0.f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < K; ++k) xf[t * 2 * pairs + k] = static_cast<float>(x[t * K + k]);
  const Bf16Args args{w16.data_ptr<c10::BFloat16>(), bias, xf.data(), y, pairs, out_features};
  const bool vector = kBf16Vector && !portable;
  for_range(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (vector) bf16_block_vector(args, b, tokens);
      else bf16_block_portable(args, b, tokens);
    }
  });
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps) {
  check(x.is_contiguous() && delta.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  check(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(), "x and delta must match");
  check(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight must match x's rows");
  at::Tensor sum = x.clone();
  at::Tensor h = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(sum.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), rows, n,
                                static_cast<float>(eps));
  });
  return {sum, h};
}

// rms_norm(x [+ delta]) * weight, in the result's dtype: weight's, x's or float32 (then
// rounded only to float32: the final norm before a float32 head).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& delta) {
  check(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && weight.numel() == x.size(1),
        "x must be contiguous (rows, n) and weight (n,)");
  check(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
        "weight must be x's dtype or float32");
  if (delta) check(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type() && delta->is_contiguous(),
                   "delta must match x");
  at::Tensor sum = delta ? x.clone() : x;  // x + delta (rounded to x's dtype), or x only read
  at::Tensor h = at::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    scalar_t* d = delta ? delta->data_ptr<scalar_t>() : nullptr;
    if (weight.scalar_type() == x.scalar_type())
      add_rms_norm_impl<scalar_t>(sum.data_ptr<scalar_t>(), d, weight.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(),
                                  rows, n, static_cast<float>(eps));
    else
      add_rms_norm_impl<scalar_t, float>(sum.data_ptr<scalar_t>(), d, weight.data_ptr<float>(), h.data_ptr<float>(),
                                         rows, n, static_cast<float>(eps));
  });
  return h;
}

// Each row's index of its largest value, the first of equal ones; a row holding a NaN gives
// its first NaN's (torch.argmax's answer, both). logits (N, V) float32, rows contiguous.
at::Tensor argmax_rows(const at::Tensor& logits) {
  check(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
        "logits must be float32 (N, V), V > 0, each row contiguous");
  const int64_t rows = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = base + r * stride;
    int64_t i = 0, best = 0;
    float top = row[0];
    bool nan = false;
#if defined(__AVX512F__)
    if (V >= 16 && V <= INT32_MAX) {  // per lane: its largest and where (strictly greater replaces)
      __m512 lane_top = _mm512_loadu_ps(row);
      __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = lane_at;
      __mmask16 unordered = _mm512_cmp_ps_mask(lane_top, lane_top, _CMP_UNORD_Q);
      const __m512i sixteen = _mm512_set1_epi32(16);
      for (i = 16; i + 16 <= V; i += 16) {
        at = _mm512_add_epi32(at, sixteen);
        const __m512 v = _mm512_loadu_ps(row + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, lane_top, _CMP_GT_OQ);
        lane_top = _mm512_mask_mov_ps(lane_top, gt, v);
        lane_at = _mm512_mask_mov_epi32(lane_at, gt, at);
      }
      nan = unordered != 0;
      alignas(64) float tops[16];
      alignas(64) int32_t ats[16];
      _mm512_store_ps(tops, lane_top);
      _mm512_store_si512(ats, lane_at);
      top = tops[0], best = ats[0];
      for (int l = 1; l < 16; ++l)
        if (tops[l] > top || (tops[l] == top && ats[l] < best)) top = tops[l], best = ats[l];
    }
#endif
    if (i == 0) i = 1;
    for (; i < V && !nan; ++i)
      if (row[i] > top) top = row[i], best = i;
      else if (row[i] != row[i]) nan = true;
    if (nan || top != top) {  // the first NaN
      best = 0;
      while (row[best] == row[best]) ++best;
    }
    o[r] = best;
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
        "gate_up must be contiguous (T, 2I)");
  const int64_t n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), n);
  });
  return out;
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

// The new tokens' attention inputs in one call: q and k rotated in place (qk: (T, H + Hkv, D)),
// then k and v (T, Hkv, D) written to the pools (S, Hkv, D) at slots (T,).
void rotary_store_(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots) {
  check(v.dim() == 3 && v.stride(2) == 1 && qk.dim() == 3 && qk.size(0) == v.size(0) &&
        qk.size(2) == v.size(2) && qk.size(1) > v.size(1), "qk must be (T, H + Hkv, D) and v (T, Hkv, D), D contiguous");
  const int64_t kv_heads = v.size(1), d = v.size(2), tokens = v.size(0);
  check(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 && k_pool.size(1) == kv_heads &&
        k_pool.size(2) == d && v_pool.sizes() == k_pool.sizes(), "pools must be contiguous (S, Hkv, D)");
  check(k_pool.scalar_type() == qk.scalar_type() && v.scalar_type() == qk.scalar_type() &&
        v_pool.scalar_type() == qk.scalar_type(), "dtypes must match");
  check(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == tokens,
        "slots must be contiguous int64 (T,)");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) check(sp[t] >= 0 && sp[t] < k_pool.size(0), "slot out of range");
  rotary_(qk, cos, sin);
  const int64_t q_heads = qk.size(1) - kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary_store_", [&] {
    store_impl<scalar_t>(qk.data_ptr<scalar_t>() + q_heads * qk.stride(1), qk.stride(0), qk.stride(1),
                         k_pool.data_ptr<scalar_t>(), sp, tokens, kv_heads, d);
    store_impl<scalar_t>(v.data_ptr<scalar_t>(), v.stride(0), v.stride(1), v_pool.data_ptr<scalar_t>(), sp,
                         tokens, kv_heads, d);
  });
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check(x.dim() == 3 && x.stride(2) == 1, "x must be (T, heads, D) with D contiguous");
  check(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
        sin.numel() == cos.numel(), "cos and sin must be contiguous (T, 1, D)");
  check(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtypes must match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                          cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& slots, const at::Tensor& row_of, const at::Tensor& lens,
                            double scale) {
  check(q.dim() == 3 && q.stride(2) == 1, "q must be (B, H, D) with D contiguous");
  check(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
        k_pool.sizes() == v_pool.sizes(), "pools must be contiguous (S, Hkv, D)");
  check(q.size(2) == k_pool.size(2) && q.size(1) % k_pool.size(1) == 0, "head shapes must match");
  check(q.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == q.scalar_type(), "dtypes must match");
  check_context(slots, row_of, lens, q.size(0), k_pool.size(0));
  const int64_t *sp = slots.data_ptr<int64_t>(), *rp = row_of.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    attention_run<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_pool.data_ptr<scalar_t>(),
                            v_pool.data_ptr<scalar_t>(), sp, rp, lp, out.data_ptr<scalar_t>(), q.size(0), q.size(1),
                            k_pool.size(1), q.size(2), slots.size(1), static_cast<float>(scale));
  });
  return out;
}

// x (T, K) bf16 @ W.T + bias -> (T, N) bf16, W int4 in the layout above, the activations on
// the 16-bit or the 8-bit grid (act_bits). `portable`: the plain C++ loop even where a
// vector path is available (tests compare the two bit for bit).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& scale, const at::Tensor& min,
                       int64_t out_features, const c10::optional<at::Tensor>& bias, bool portable, int64_t act_bits) {
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous bf16 (T, K)");
  const c10::BFloat16* bias_p = int4_checked(x.size(1), q4, scale, min, out_features, bias, act_bits);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  int4_run(x.data_ptr<c10::BFloat16>(), x.size(0), q4, scale, min, out_features, bias_p, portable, act_bits,
           y.data_ptr<c10::BFloat16>());
  return y;
}

// x (T, K) float32 @ W.T -> (T, N) float32, W Q8_0 in the layout above. `portable`: the
// plain C++ loop even where AVX-512 is available (tests compare the two bit for bit).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scale, int64_t out_features,
                     bool portable) {
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32 (T, K)");
  const int64_t tokens = x.size(0), K = x.size(1), blocks = q8.size(0);
  check(K % kQ8Group == 0 && q8.dim() == 3 && q8.is_contiguous() && q8.scalar_type() == at::kChar &&
        q8.size(1) == K && q8.size(2) == kQ8Block, "q8 must be contiguous int8 (N/16, K, 16)");
  check(out_features > (blocks - 1) * kQ8Block && out_features <= blocks * kQ8Block, "out_features must fit q8's blocks");
  check(scale.is_contiguous() && scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(0) == blocks &&
        scale.size(1) == K / kQ8Group && scale.size(2) == kQ8Block, "scale must be contiguous fp16 (N/16, K/32, 16)");
  thread_local RoundedActivations r;
  r.round(x.data_ptr<float>(), tokens, K, false);
  const int64_t groups = K / kQ8Group;
  at::Tensor y = at::empty({tokens, out_features}, x.options());
  const Q8Args args{q8.data_ptr<int8_t>(), scale.data_ptr<c10::Half>(), r.xq.data(), r.step.data(),
                    y.data_ptr<float>(), K, out_features, groups};
  const bool vector = kQ8Vector && !portable;
  for_range(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (vector) q8_block_vector(args, b, tokens);
      else q8_block_portable(args, b, tokens);
    }
  });
  return y;
}

// x (T, K) bf16 @ W.T + bias -> (T, N) bf16, W bf16 in the layout above. `portable`: the
// plain C++ loop even where AVX-512 is available (tests compare the two bit for bit).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w16, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool portable) {
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous bf16 (T, K)");
  const c10::BFloat16* bias_p = bf16_checked(x.size(1), w16, out_features, bias);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  bf16_run(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), w16, out_features, bias_p, portable,
           y.data_ptr<c10::BFloat16>());
  return y;
}

// RefinedHead's refinement (quant.py), in place: for each row r of logits (N, V) float32,
// with bound b = coef * ||x[r]|| + 1e-3, every logit within 2 b of the row's largest is
// recomputed in float32 as W[v] . x[r] (W (V, K) float32). Returns how many were, or -1 as
// soon as more than max_count would be (the caller then computes the whole float32 head;
// logits is then partly overwritten). Each row on its own: a row's result never depends
// on the others.
int64_t refine_head(at::Tensor logits, const at::Tensor& x, const at::Tensor& weight, double coef,
                    int64_t max_count) {
  check(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
        "logits must be contiguous float32 (N, V)");
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) == logits.size(0),
        "x must be contiguous float32 (N, K)");
  check(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
        weight.size(0) == logits.size(1) && weight.size(1) == x.size(1), "weight must be contiguous float32 (V, K)");
  const int64_t rows = logits.size(0), V = logits.size(1), K = x.size(1);
  float* lp = logits.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  std::atomic<int64_t> count{0};
  for_range(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1 && count.load() <= max_count; ++r) {
      const float* xr = xp + r * K;
      float* lr = lp + r * V;
      const float bound = static_cast<float>(coef) * std::sqrt(dot(xr, xr, K)) + 1e-3f;
      float top = -INFINITY;
      int64_t v0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 tops = _mm256_set1_ps(-INFINITY);
      for (; v0 + 8 <= V; v0 += 8) tops = _mm256_max_ps(_mm256_loadu_ps(lr + v0), tops);  // NaN skipped, as std::max
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, tops);
      top = *std::max_element(lanes, lanes + 8);
#endif
      for (int64_t v = v0; v < V; ++v) top = std::max(top, lr[v]);
      const float floor = top - 2 * bound;
      for (int64_t v = 0; v < V; ++v) {
#if defined(__AVX2__) && defined(__FMA__)
        if (v % 8 == 0 && v + 8 <= V &&  // 8 at a time past logits that are not candidates
            !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(lr + v), _mm256_set1_ps(floor), _CMP_GE_OQ))) {
          v += 7;
          continue;
        }
#endif
        if (!(lr[v] >= floor)) continue;
        if (count.fetch_add(1) + 1 > max_count) return;
        lr[v] = dot(xr, wp + v * K, K);
      }
    }
  });
  return count.load() > max_count ? -1 : count.load();
}

// --- a decoder's layers in one call ---------------------------------------------------------
//
// For a pass whose every query the attention kernel takes (decode and verify rows, no
// prefill chunk), the layers run here with the kernels above, in exactly the order
// LlamaModel.forward calls them with kernels on (the same functions: bit-identical), so a
// step costs one Python call instead of ~10 a layer plus their views and dispatch.
//
// The whole pass is one OpenMP parallel region: every thread walks the layers and runs its
// share of each kernel (for_range), with a barrier wherever the next kernel reads what the
// last one wrote. Called one by one, each kernel forks and joins its own threads and
// allocates its output; at batch 1 that is ~150 forks a step for ~100 us of streaming each,
// and each fork restarts the weight streams cold. Arguments are checked before the region
// (add_layer checks the weights once), buffers are allocated once a pass, and nothing in
// the region can throw. Each thread rounds a linear's input into its own buffers (a few
// hundred values, repeated per thread) rather than waiting at one more barrier.
struct StackLinear {
  int64_t kind;                    // 0: int4 (q4, scale, min), 2: the same on the 8-bit grid, 1: bf16 (w16)
  std::vector<at::Tensor> weights;
  int64_t in_features, out_features;
  c10::optional<at::Tensor> bias;
  const c10::BFloat16* bias_data;  // bias's, checked (nullptr: none)

  // y (T, out_features) = x (T, in_features) @ W.T + bias: this thread's share.
  void run(const c10::BFloat16* x, int64_t tokens, c10::BFloat16* y) const {
    if (kind == 1) bf16_run(x, tokens, in_features, weights[0], out_features, bias_data, false, y);
    else int4_run(x, tokens, weights[0], weights[1], weights[2], out_features, bias_data, false, kind == 2 ? 8 : 16, y);
  }
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
};

// Marks the calling thread as member `id` of a team of `size` for its lifetime (see for_range).
struct TeamMember {
  TeamMember(int id, int size) { t_team = {id, size}; }
  ~TeamMember() { t_team = {}; }
};

class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps) {}

  using LinearSpec = std::tuple<int64_t, std::vector<at::Tensor>, int64_t, c10::optional<at::Tensor>>;

  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const std::vector<LinearSpec>& linears) {
    check(linears.size() == 4, "a layer needs 4 linears: qkv, o, gate_up, down");
    const int64_t hidden = input_norm.numel();
    check(hidden > 0 && (layers_.empty() || hidden == hidden_), "every layer has the same hidden size");
    for (const at::Tensor* w : {&input_norm, &post_norm})
      check(w->is_contiguous() && w->scalar_type() == at::kBFloat16 && w->numel() == hidden,
            "norm weights must be contiguous bf16 (hidden,)");
    const int64_t intermediate = std::get<2>(linears[2]) / 2;
    const int64_t in[4] = {hidden, heads_ * d_, hidden, intermediate};
    const int64_t out[4] = {(heads_ + 2 * kv_heads_) * d_, hidden, 2 * intermediate, hidden};
    check(layers_.empty() || intermediate == intermediate_, "every layer has the same intermediate size");
    std::vector<StackLinear> ls;
    for (int i = 0; i < 4; ++i) {
      const auto& [kind, weights, out_features, bias] = linears[i];
      check(out_features == out[i], "linear shapes must be qkv (H + 2 Hkv) D, o hidden, gate_up 2 I, down hidden");
      check(((kind == 0 || kind == 2) && weights.size() == 3) || (kind == 1 && weights.size() == 1),
            "a linear is int4 (kind 0, or 2 on the 8-bit activation grid: q4, scale, min) or bf16 (kind 1: w16)");
      const c10::BFloat16* bias_data =
          kind == 1 ? bf16_checked(in[i], weights[0], out_features, bias)
                    : int4_checked(in[i], weights[0], weights[1], weights[2], out_features, bias, kind == 2 ? 8 : 16);
      ls.push_back({kind, weights, in[i], out_features, bias, bias_data});
    }
    hidden_ = hidden;
    intermediate_ = intermediate;
    layers_.push_back({input_norm, post_norm, ls[0], ls[1], ls[2], ls[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x (T, hidden) -> the last layer's output (the residual stream), or with final_norm
  // (hidden,) float32 that stream's rms_norm(...) * final_norm in float32 (the model's
  // final norm, as the `rms_norm` kernel computes it).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                     const at::Tensor& slot_mapping, const at::Tensor& context_slots, const at::Tensor& rows,
                     const at::Tensor& lens, double scale, const c10::optional<at::Tensor>& final_norm) const {
    using BF16 = c10::BFloat16;
    check(!layers_.empty(), "the stack has no layers");
    check(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(), "one K and one V pool per layer");
    check(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kBFloat16, "x must be bf16 (T, hidden)");
    const int64_t T = x.size(0), H = heads_, Hkv = kv_heads_, D = d_;
    check(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 &&
          sin.scalar_type() == at::kBFloat16 && cos.numel() == T * D && sin.numel() == T * D,
          "cos and sin must be contiguous bf16 (T, 1, D)");
    const int64_t S = k_pools[0].size(0);
    for (size_t l = 0; l < layers_.size(); ++l)
      for (const at::Tensor* pool : {&k_pools[l], &v_pools[l]})
        check(pool->is_contiguous() && pool->scalar_type() == at::kBFloat16 && pool->dim() == 3 &&
              pool->size(0) == S && pool->size(1) == Hkv && pool->size(2) == D,
              "pools must be contiguous bf16 (S, Hkv, D), the same S in every layer");
    check(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
          "slot_mapping must be contiguous int64 (T,)");
    const int64_t* slot_p = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) check(slot_p[t] >= 0 && slot_p[t] < S, "slot out of range");
    check_context(context_slots, rows, lens, T, S);
    const int64_t C = context_slots.size(1);
    const int64_t *ctx_p = context_slots.data_ptr<int64_t>(), *rows_p = rows.data_ptr<int64_t>(),
                  *lens_p = lens.data_ptr<int64_t>();

    if (final_norm)
      check(final_norm->is_contiguous() && final_norm->scalar_type() == at::kFloat && final_norm->numel() == hidden_,
            "final_norm must be contiguous float32 (hidden,)");
    const float* final_p = final_norm ? final_norm->data_ptr<float>() : nullptr;
    // The residual stream x is updated in place (add_rms_norm_impl), every kernel's output
    // in a buffer of the pass.
    const at::Tensor res = x.clone(at::MemoryFormat::Contiguous);
    const auto buffer = [&](int64_t n) { return at::empty({T, n}, x.options()); };
    const int64_t qkv_row = (H + 2 * Hkv) * D;
    const at::Tensor h = buffer(hidden_), qkv = buffer(qkv_row), attn = buffer(H * D), o = buffer(hidden_),
                     gate_up = buffer(2 * intermediate_), act = buffer(intermediate_), down = buffer(hidden_);
    const at::Tensor out = final_p ? at::empty({T, hidden_}, x.options().dtype(at::kFloat)) : at::Tensor();
    BF16 *res_p = res.data_ptr<BF16>(), *h_p = h.data_ptr<BF16>(), *qkv_p = qkv.data_ptr<BF16>(),
         *attn_p = attn.data_ptr<BF16>(), *o_p = o.data_ptr<BF16>(), *gu_p = gate_up.data_ptr<BF16>(),
         *act_p = act.data_ptr<BF16>(), *down_p = down.data_ptr<BF16>();
    const BF16 *cos_p = cos.data_ptr<BF16>(), *sin_p = sin.data_ptr<BF16>();
    const float eps = static_cast<float>(eps_);
    at::internal::lazy_init_num_threads();  // this thread's OpenMP team size = torch's thread count
#pragma omp parallel
    {
      const TeamMember member(omp_get_thread_num(), omp_get_num_threads());
      for (size_t l = 0; l < layers_.size(); ++l) {
        const StackLayer& L = layers_[l];
        BF16* kp = k_pools[l].data_ptr<BF16>();
        BF16* vp = v_pools[l].data_ptr<BF16>();
        add_rms_norm_impl(res_p, l > 0 ? down_p : nullptr, L.input_norm.data_ptr<BF16>(), h_p, T, hidden_, eps);
#pragma omp barrier
        L.qkv.run(h_p, T, qkv_p);
#pragma omp barrier
        rotary_impl(qkv_p, T, H + Hkv, D, qkv_row, D, cos_p, sin_p);  // q and k
#pragma omp barrier
        store_impl(qkv_p + H * D, qkv_row, D, kp, slot_p, T, Hkv, D);
        store_impl(qkv_p + (H + Hkv) * D, qkv_row, D, vp, slot_p, T, Hkv, D);
#pragma omp barrier
        attention_run(qkv_p, qkv_row, D, kp, vp, ctx_p, rows_p, lens_p, attn_p, T, H, Hkv, D, C,
                      static_cast<float>(scale));
#pragma omp barrier
        L.o.run(attn_p, T, o_p);
#pragma omp barrier
        add_rms_norm_impl(res_p, o_p, L.post_norm.data_ptr<BF16>(), h_p, T, hidden_, eps);
#pragma omp barrier
        L.gate_up.run(h_p, T, gu_p);
#pragma omp barrier
        silu_mul_impl(gu_p, act_p, T, intermediate_);
#pragma omp barrier
        L.down.run(act_p, T, down_p);
#pragma omp barrier
      }
      if (final_p) add_rms_norm_impl(res_p, down_p, final_p, out.data_ptr<float>(), T, hidden_, eps);
    }
    return final_p ? out : res + down;
  }

 private:
  std::vector<StackLayer> layers_;
  int64_t heads_, kv_heads_, d_;
  double eps_;
  int64_t hidden_ = 0, intermediate_ = 0;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x + delta and rms_norm(x + delta) * weight, in one pass");
  m.def("rms_norm", &rms_norm, "rms_norm(x [+ delta]) * weight, in weight's dtype", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("delta") = py::none());
  m.def("argmax_rows", &argmax_rows, "each row's first largest value's index (a NaN's, if any)");
  m.def("rotary_", &rotary_, "rotary embedding in place (half-rotation layout, signed sin)");
  m.def("decode_attention", &decode_attention, "per-query attention over paged K/V");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate/up output");
  m.def("rotary_store_", &rotary_store_, "rotate q, k in place and write k, v to the pools at slots");
  m.def("int4_linear", &int4_linear, "x @ W.T + bias with W int4 (groups of 32, fp16 scale and min)",
        py::arg("x"), py::arg("q4"), py::arg("scale"), py::arg("min"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("portable") = false, py::arg("act_bits") = 16);
  m.attr("int4_vector") = kInt4Vector;
  m.attr("int4_amx") = kInt4Amx && amx_permitted();  // passes of 32+ tokens on AMX tiles
  m.def("set_int4_amx", [](bool on) { return g_int4_amx.exchange(on); },
        "whether int4 passes of 32+ tokens may use AMX tiles (default yes); returns the previous setting");
  m.def("bf16_linear", &bf16_linear, "x @ W.T + bias with W bf16 (blocks of 16 outputs, k in pairs)",
        py::arg("x"), py::arg("w16"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("portable") = false);
  m.attr("bf16_vector") = kBf16Vector;
  m.def("q8_linear", &q8_linear, "x @ W.T with W Q8_0 (int8 codes, fp16 scale per 32), float32 in and out",
        py::arg("x"), py::arg("q8"), py::arg("scale"), py::arg("out_features"), py::arg("portable") = false);
  m.attr("q8_vector") = kQ8Vector;
  m.def("refine_head", &refine_head, "recompute in float32 the logits within 2 bounds of each row's largest",
        py::arg("logits"), py::arg("x"), py::arg("weight"), py::arg("coef"), py::arg("max_count"));
  m.attr("isa") = kIsa;
  py::class_<DecoderStack>(m, "DecoderStack", "a decoder's layers in one call (decode and verify passes)")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"))
      .def("add_layer", &DecoderStack::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("linears"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_pools"),
           py::arg("v_pools"), py::arg("slot_mapping"), py::arg("context_slots"), py::arg("rows"), py::arg("lens"),
           py::arg("scale"), py::arg("final_norm") = py::none());
}
