// Fused element-wise ops of a Llama layer: RMSNorm, SiLU-and-multiply, rotary embedding, in bf16 or fp32
// (fp32 through the generic loops, which the compiler vectorizes for the machine). Each replaces several
// PyTorch ops (and their passes over memory) with one, and rounds to the dtype exactly where the unfused
// torch code does (after each op), so results match it up to the last bit of an exp or a sum order. Rows
// are spread over torch's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.h"

namespace {

using namespace kvpool_kernels;
using Bf16 = c10::BFloat16;

inline float round_bf16(float x) { return static_cast<float>(static_cast<Bf16>(x)); }
// Rounding to the tensor's dtype after each op, as the unfused torch code rounds: to bf16, or none in fp32.
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return round_bf16(x);
  } else {
    return x;
  }
}

#ifdef KVPOOL_AVX512_BF16
// Sixteen lanes at a time, with masked loads and stores only for a row's tail: one code path per element.
// (Masked loads and stores of every vector ran these memory-bound ops at half speed on AMD Zen: 1.3 ->
// 0.7 ms for one layer's SiLU-and-multiply over 2,048 tokens, from a cold cache.)
inline __m512 load16(const Bf16* p, __mmask16 m) {
  const __m256i raw = m == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to nearest even
inline __m512 round16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
inline void store16(Bf16* p, __m512 x, __mmask16 m) {
  if (m == 0xFFFF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
  } else {
    _mm256_mask_storeu_epi16(p, m, to_bf16(x));
  }
}
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
#endif

// bf16, or fp32 (the generic loops, which the compiler vectorizes for the machine): `like`'s dtype.
void check_same(const at::Tensor& t, const at::Tensor& like, const char* name) {
  KV_CHECK(t.scalar_type() == like.scalar_type() && t.is_contiguous(), name, " must be a contiguous ",
              like.scalar_type(), " tensor like the input");
}

void check_float_or_bf16(const at::Tensor& t, const char* name) {
  KV_CHECK((t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) && t.is_contiguous(), name,
              " must be a contiguous bfloat16 or float32 tensor");
}

// weight * (x / rms(x)): the normalization in fp32, rounded to bf16, then the bf16 product, as
// kvpool.runner.models.llama.RMSNorm (and transformers' LlamaRMSNorm) compute it.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float e, at::Tensor& out) {
  const int64_t h = weight.numel();
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, x.numel() / h, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * h;
      float ss = 0.0f;
      for (int64_t i = 0; i < h; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + e);
      for (int64_t i = 0; i < h; ++i) op[r * h + i] = static_cast<T>(to_float(wp[i]) * round_to<T>(to_float(xr[i]) * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_float_or_bf16(x, "x");
  check_same(weight, x, "weight");
  check_same(out, x, "out");
  const int64_t h = weight.numel();
  KV_CHECK(h >= 1, "weight must not be empty");
  KV_CHECK(x.dim() >= 1 && x.size(-1) == h && out.sizes() == x.sizes(), "x and out must be (..., ", h, ")");
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, weight, static_cast<float>(eps), out);
  } else {
    rms_norm_rows<Bf16>(x, weight, static_cast<float>(eps), out);
  }
  return out;
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension; silu rounded to bf16 first, as
// F.silu(gate) * up does.
template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = out.size(-1);
  const T* gp = gate_up.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, out.numel() / n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * n;
      const T* u = g + n;
#ifdef KVPOOL_AVX512_BF16
      if constexpr (std::is_same_v<T, Bf16>) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int64_t i = 0; i < n; i += 16) {
          const __mmask16 m = tail_mask(n - i);
          const __m512 x = load16(g + i, m);
          const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // exp(-|x|)
          const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
          // Below -87 exp(x) is under fp32's normal range, where exp_nonpositive stops: sigmoid(x) is 0 there
          // (else silu(-1e38) would be -1.65; with 0, silu(-inf) is NaN, as F.silu gives).
          const __m512 sig = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ),
              _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, inv));
          store16(op + r * n + i, _mm512_mul_ps(round16(_mm512_mul_ps(x, sig)), load16(u + i, m)), m);
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) {
        const float x = to_float(g[i]);
        const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|) never overflows
        const float sig = x >= 0.0f ? 1.0f / (1.0f + e) : x >= -87.0f ? e / (1.0f + e) : 0.0f;  // (as above)
        op[r * n + i] = static_cast<T>(round_to<T>(x * sig) * to_float(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, at::Tensor out) {
  check_float_or_bf16(gate_up, "gate_up");
  check_same(out, gate_up, "out");
  KV_CHECK(out.dim() >= 1 && out.size(-1) >= 1, "out must be (..., n) with n >= 1");
  const int64_t n = out.size(-1);
  KV_CHECK(gate_up.dim() == out.dim() && gate_up.sizes().slice(0, out.dim() - 1) == out.sizes().slice(0, out.dim() - 1) &&
               gate_up.size(-1) == 2 * n, "gate_up must be out's rows, twice as wide");
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(gate_up, out);
  } else {
    silu_and_mul_rows<Bf16>(gate_up, out);
  }
  return out;
}

#pragma GCC pop_options

// Rotary embedding by halves (the Hugging Face convention) of x: (T, heads, D) with any token and head
// strides, D contiguous; cos, sin: (max_position, D / 2) fp32 tables. Each product and sum is rounded to
// bf16 as the unfused x1 * cos - x2 * sin (with cos, sin first cast to bf16) rounds it.
// Products and sums rounded one by one as torch's separate ops round them: in fp32 the compiler would
// otherwise fuse x1 * c - x2 * s into an FMA (one rounding), and the result would not be torch's bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotary_rows(const at::Tensor& x, const int64_t* pos, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& out) {
  const int64_t t_n = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  const int64_t s_tok = x.stride(0), s_head = x.stride(1);
  at::parallel_for(0, t_n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + pos[t] * half;
      const float* st = sp + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = xp + t * s_tok + h * s_head;
        T* o = op + (t * heads + h) * d;
#ifdef KVPOOL_AVX512_BF16
        if constexpr (std::is_same_v<T, Bf16>) {
          for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = tail_mask(half - i);
            const __m512 c = round16(_mm512_maskz_loadu_ps(m, ct + i)), s = round16(_mm512_maskz_loadu_ps(m, st + i));
            const __m512 x1 = load16(xr + i, m), x2 = load16(xr + i + half, m);
            store16(o + i, _mm512_sub_ps(round16(_mm512_mul_ps(x1, c)), round16(_mm512_mul_ps(x2, s))), m);
            store16(o + i + half, _mm512_add_ps(round16(_mm512_mul_ps(x2, c)), round16(_mm512_mul_ps(x1, s))), m);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_to<T>(ct[i]), s = round_to<T>(st[i]);
          const float x1 = to_float(xr[i]), x2 = to_float(xr[i + half]);
          o[i] = static_cast<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
          o[i + half] = static_cast<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
        }
      }
    }
  });
}

#pragma GCC pop_options

// Rotary embedding by halves (the Hugging Face convention) of x: (T, heads, D) with any token and head
// strides, D contiguous; cos, sin: (max_position, D / 2) fp32 tables. Each product and sum is rounded to
// x's dtype as the unfused x1 * cos - x2 * sin (with cos, sin first cast to that dtype) rounds it.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor out) {
  KV_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 3 && x.stride(2) == 1,
              "x must be a bfloat16 or float32 (T, heads, head_dim) tensor with head_dim contiguous");
  check_same(out, x, "out");
  KV_CHECK(out.sizes() == x.sizes(), "out must be shaped like x");
  KV_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be a contiguous int64 (T,) tensor");
  const int64_t d = x.size(2), half = d / 2;
  KV_CHECK(d % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 (max_position, head_dim / 2) tables");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    KV_CHECK(0 <= pos[t] && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary table's ",
                cos.size(0), " positions");
  }
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(x, pos, cos, sin, out);
  } else {
    rotary_rows<Bf16>(x, pos, cos, sin, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> Tensor(a!)");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> Tensor(a!)");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rotary(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) out) -> Tensor(a!)");
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
}
