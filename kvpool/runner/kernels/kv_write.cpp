// Writing a step's keys and values into the paged cache at their slots: one op for both tensors in place
// of two index_copy_ calls, whose per-call overhead (and the transposed copies they make) dominated the
// few kilobytes a decode step writes per layer.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common.h"

namespace {

using kvpool_kernels::kv_elem_of;
using kvpool_kernels::narrow_kv;
using kvpool_kernels::with_kv_elem;

// The checks both writes make. k, v: (T, kv_heads, D), D contiguous, any token and head strides (views of
// the fused qkv projection); k_cache, v_cache: contiguous (kv_heads, blocks, block_size, D) of the same
// dtype (or bf16, fp16 or fp8 caches of fp32 keys and values: a narrower KV cache under an fp32 model,
// rounded by to_cache); slots: (T,) int64, token t goes to block slots[t] /
// block_size, offset slots[t] % block_size. Slots must be distinct.
void check_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slots) {
  KV_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be (T, kv_heads, head_dim) tensors with head_dim contiguous");
  KV_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must be contiguous (kv_heads, blocks, block_size, head_dim)");
  const bool narrowed = k.scalar_type() == at::kFloat && narrow_kv(k_cache.scalar_type());
  KV_CHECK((k.scalar_type() == k_cache.scalar_type() || narrowed) && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches must share one dtype (or be float32 into bfloat16, float16 or fp8 caches)");
  KV_CHECK(k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(3), "k and the caches disagree on kv_heads or head_dim");
  KV_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0),
              "slots must be a contiguous int64 (T,) tensor");
  const int64_t capacity = k_cache.size(1) * k_cache.size(2);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    KV_CHECK(0 <= sp[t] && sp[t] < capacity, "token ", t, ": slot ", sp[t], " is outside the cache's ", capacity, " slots");
  }
}

// x as a cache element of type C: rounded to nearest even as torch's `.to()` rounds, and for fp16 and fp8
// clamped to their largest finite value first (kvpool.runner.dtypes.round_to: a number past the range is
// stored saturated, never as inf or NaN; NaN fails both comparisons and stays NaN).
template <typename C>
inline C to_cache(float x) {
  if constexpr (std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>) {
    return static_cast<C>(x);
  } else {
    const float top = static_cast<float>(std::numeric_limits<C>::max());
    return static_cast<C>(x > top ? top : x < -top ? -top : x);
  }
}

#ifdef __AVX2__
// 8 floats, already clamped to the format's range (or NaN), as 8 fp8 bytes (the low 8 of the result),
// bit for bit c10's scalar conversion (torch's `.to()`): normals rounded to nearest even by adding
// half an ulp less one plus the kept mantissa's lowest bit, subnormals rounded by one float addition of a
// power of two whose ulp is the subnormal step. Shift: 23 minus the mantissa bits; Rebias: the exponent
// bias difference (shifted); SubBelow: the smallest normal's bits; Denorm: the power of two's bits.
template <int Shift, uint32_t Rebias, uint32_t SubBelow, uint32_t Denorm>
inline __m128i fp8_from8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i f = _mm256_xor_si256(bits, sign);  // |x|, positive as int32 (NaN too)
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(f, Shift), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(f, _mm256_set1_epi32(static_cast<int>(Rebias + (1u << (Shift - 1)) - 1))), odd),
      Shift);
  const __m256i denorm = _mm256_set1_epi32(static_cast<int>(Denorm));
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(f), _mm256_castsi256_ps(denorm))), denorm);
  __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(SubBelow)), f));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(f, _mm256_set1_epi32(0x7f800000)));
  r = _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi32(0xff)), _mm256_srli_epi32(sign, 24));
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  return _mm_packus_epi16(w, w);
}
#endif

// One token's head_dim elements, converted to the cache's element type. fp8 eight at a time where AVX2 is
// (c10's conversion is a branchy scalar function: a 2,048-token prompt step writes 24 million elements).
template <typename C>
inline void put(C* dst, const float* src, int64_t dim) {
  int64_t d = 0;
#ifdef __AVX2__
  constexpr bool e4m3 = std::is_same_v<C, c10::Float8_e4m3fn>, e5m2 = std::is_same_v<C, c10::Float8_e5m2>;
  if constexpr (e4m3 || e5m2) {
    const __m256 top = _mm256_set1_ps(static_cast<float>(std::numeric_limits<C>::max()));
    const __m256 bottom = _mm256_sub_ps(_mm256_setzero_ps(), top);
    for (; d + 8 <= dim; d += 8) {
      // Clamped as to_cache clamps: min and max return their second operand when one is NaN, so NaN stays.
      const __m256 x = _mm256_max_ps(bottom, _mm256_min_ps(top, _mm256_loadu_ps(src + d)));
      const __m128i b = e4m3 ? fp8_from8<20, static_cast<uint32_t>(7 - 127) << 23, 121u << 23, 141u << 23>(x)
                             : fp8_from8<21, static_cast<uint32_t>(15 - 127) << 23, 113u << 23, 134u << 23>(x);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), b);
    }
  }
#endif
  for (; d < dim; ++d) dst[d] = to_cache<C>(src[d]);
}

// fp32 keys and values into caches of C elements (fp32, or bf16, fp16 or fp8 under an fp32 model), rounded
// as to_cache rounds. `packed`: as prefill_f32.cpp reads them, within a block every 8 tokens' keys form a
// tile of [head_dim][8] (key t's element d at [d][t], what the kernel's transposes made at every read);
// values stay in rows, which it reads in place. Else keys in rows too (standard layout).
template <typename C>
void write_kv_f32(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slots, bool packed) {
  KV_CHECK(!packed || k_cache.size(2) % 8 == 0, "packed float32 caches need blocks of a multiple of 8 tokens");
  KV_CHECK(!packed || sizeof(C) != 1 || k.size(2) <= 256, "packed fp8 caches take head_dim <= 256");
  const int64_t n = k.size(0), heads = k.size(1), dim = k.size(2), head_stride = k_cache.stride(0);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  C* kc = k_cache.mutable_data_ptr<C>();
  C* vc = v_cache.mutable_data_ptr<C>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tile = sp[t] / 8, i = sp[t] % 8;  // tiles are whole within a block (8 | block_size)
      for (int64_t h = 0; h < heads; ++h) {
        const float* ks = kp + t * k.stride(0) + h * k.stride(1);
        if (packed) {
          C* kt = kc + h * head_stride + tile * 8 * dim;
          if constexpr (sizeof(C) == 1) {  // (converted eight at a time, then placed)
            C row[256];
            put(row, ks, dim);
            for (int64_t d = 0; d < dim; ++d) kt[d * 8 + i] = row[d];
          } else {
            for (int64_t d = 0; d < dim; ++d) kt[d * 8 + i] = to_cache<C>(ks[d]);
          }
        } else {
          put(kc + h * head_stride + sp[t] * dim, ks, dim);
        }
        put(vc + h * head_stride + sp[t] * dim, vp + t * v.stride(0) + h * v.stride(1), dim);
      }
    }
  });
}

// write_kv_f32 for the caches' element type.
void write_kv_from_f32(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slots, bool packed) {
  with_kv_elem(kv_elem_of(k_cache.scalar_type()), [&](auto t) {
    write_kv_f32<typename decltype(t)::type>(k, v, k_cache, v_cache, slots, packed);
  });
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  check_write(k, v, k_cache, v_cache, slots);
  if (k.scalar_type() != k_cache.scalar_type()) {
    write_kv_from_f32(k, v, k_cache, v_cache, slots, false);
    return;
  }
  const int64_t n = k.size(0), heads = k.size(1), dim = k.size(2), head_stride = k_cache.stride(0);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t elem = static_cast<int64_t>(k.element_size()), bytes = dim * elem;
  const auto* kp = static_cast<const char*>(k.const_data_ptr());
  const auto* vp = static_cast<const char*>(v.const_data_ptr());
  auto* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  auto* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (h * head_stride + sp[t] * dim) * elem;
        std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * elem, bytes);
        std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * elem, bytes);
      }
    }
  });
}

// The same into caches laid out as the attention kernels read them (done once at write time instead of at
// every read). bf16 (prefill_attention.cpp's pack_keys and pack_values): within a block, every 16 tokens
// form a tile; a key tile is [head_dim / 2][16] pairs (key t's elements 2p, 2p + 1 at [p][t]), a value
// tile [8][head_dim] pairs (element d of tokens 2j and 2j + 1 at [j][d]). fp32: write_kv_f32.
// Whole blocks keep their bytes together, so swaps and the store copy them as before.
void write_kv_packed(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slots) {
  check_write(k, v, k_cache, v_cache, slots);
  if (k.scalar_type() == at::kFloat) {
    write_kv_from_f32(k, v, k_cache, v_cache, slots, true);
    return;
  }
  KV_CHECK(k_cache.element_size() == 2, "packed caches hold float32 or a 16-bit dtype");
  KV_CHECK(k_cache.size(2) % 16 == 0 && k_cache.size(3) % 2 == 0, "packed caches need blocks of a multiple of 16 tokens");
  const int64_t n = k.size(0), heads = k.size(1), dim = k.size(2), pairs = dim / 2, head_stride = k_cache.stride(0);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const auto* kp = static_cast<const uint16_t*>(k.const_data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v.const_data_ptr());
  auto* kc = static_cast<uint16_t*>(k_cache.mutable_data_ptr());
  auto* vc = static_cast<uint16_t*>(v_cache.mutable_data_ptr());
  // A token's key lands in head_dim / 2 lines of its tile (one pair each) and its value in a few more: for the
  // few scattered tokens of a decode step, each line is a miss to memory. So a run of 16 tokens first asks for
  // all its lines (for writing), then writes them, and two threads share the tokens: a 64-token step's writes
  // measured ~2.6x faster (random slots, 30 layers' caches) than one thread writing as it goes.
  // Where token t's tile starts in kv head h's pages (tiles are whole within a block: 16 | block_size).
  const auto tile_at = [&](int64_t t, int64_t h) { return h * head_stride + sp[t] / 16 * 16 * dim; };
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += 16) {
      const int64_t t1 = std::min<int64_t>(end, t0 + 16);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = sp[t] % 16;
        for (int64_t h = 0; h < heads; ++h) {
          const uint16_t* kt = kc + tile_at(t, h);
          const uint16_t* vt = vc + tile_at(t, h);
          for (int64_t p = 0; p < pairs; ++p) __builtin_prefetch(kt + (p * 16 + i) * 2, 1, 3);
          for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(vt + ((i / 2) * dim + d) * 2, 1, 3);
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = sp[t] % 16;
        for (int64_t h = 0; h < heads; ++h) {
          const uint16_t* ks = kp + t * k.stride(0) + h * k.stride(1);
          const uint16_t* vs = vp + t * v.stride(0) + h * v.stride(1);
          uint16_t* kt = kc + tile_at(t, h);
          uint16_t* vt = vc + tile_at(t, h);
          for (int64_t p = 0; p < pairs; ++p) {
            kt[(p * 16 + i) * 2] = ks[2 * p];
            kt[(p * 16 + i) * 2 + 1] = ks[2 * p + 1];
          }
          for (int64_t d = 0; d < dim; ++d) vt[((i / 2) * dim + d) * 2 + i % 2] = vs[d];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
  m.def("write_kv_packed(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv_packed", c10::DispatchKey::CPU, &write_kv_packed);
}
