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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }

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

// x <- x + delta (rounded to T, as `x + delta` is), h <- rms_norm(x) * w (accumulated in
// float32, rounded once, as F.rms_norm is). x, delta, h: (rows, n) contiguous.
template <typename T>
void add_rms_norm_impl(T* x, const T* delta, const T* w, T* h, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> xs(n);
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * n;
      const T* dr = delta + r * n;
      T* hr = h + r * n;
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        T sum = static_cast<T>(f32(xr[i]) + f32(dr[i]));
        xr[i] = sum;
        xs[i] = f32(sum);
        ss += xs[i] * xs[i];
      }
      float rstd = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) hr[i] = static_cast<T>(xs[i] * rstd * f32(w[i]));
    }
  });
}

// In place, x (T, heads, D) strided over T and heads, D contiguous:
// x <- round(round(x * cos) + swap_halves(x) * sin), sin signed (see llama.apply_rotary).
template <typename T>
void rotary_impl(T* x, int64_t tokens, int64_t heads, int64_t d, int64_t s_tok, int64_t s_head,
                 const T* cos, const T* sin) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, hd = i % heads;
      T* xr = x + t * s_tok + hd * s_head;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
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
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
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
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      std::copy(x + t * s_tok + h * s_head, x + t * s_tok + h * s_head + d, pool + (slots[t] * heads + h) * d);
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
  int64_t work = 0;
  for (int64_t b = 0; b < rows; ++b) work += lens[b];
  const int64_t grain = work * heads * d < 65536 ? rows * heads : 1;  // small: one thread
  at::parallel_for(0, rows * heads, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> qv(d), acc(d), scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / heads, h = i % heads, kh = h / per_kv;
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
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "verispec kernels: ", what); }

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
  check(slots.dim() == 2 && slots.is_contiguous() && slots.scalar_type() == at::kLong,
        "slots must be contiguous int64 (R, C)");
  check(lens.is_contiguous() && lens.scalar_type() == at::kLong && lens.numel() == q.size(0) &&
        row_of.is_contiguous() && row_of.scalar_type() == at::kLong && row_of.numel() == q.size(0),
        "row_of and lens must be contiguous int64 (N,)");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rp = row_of.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i) {
    check(rp[i] >= 0 && rp[i] < slots.size(0), "row_of out of range");
    check(lp[i] >= 1 && lp[i] <= slots.size(1), "each query needs 1..C context slots");
    for (int64_t c = 0; c < lp[i]; ++c)
      check(sp[rp[i] * slots.size(1) + c] >= 0 && sp[rp[i] * slots.size(1) + c] < k_pool.size(0),
            "slot out of range");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_pool.data_ptr<scalar_t>(),
                                    v_pool.data_ptr<scalar_t>(), sp, rp, lp,
                                    out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_pool.size(1),
                                    q.size(2), slots.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x + delta and rms_norm(x + delta) * weight, in one pass");
  m.def("rotary_", &rotary_, "rotary embedding in place (half-rotation layout, signed sin)");
  m.def("decode_attention", &decode_attention, "per-query attention over paged K/V");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate/up output");
  m.def("rotary_store_", &rotary_store_, "rotate q, k in place and write k, v to the pools at slots");
}
