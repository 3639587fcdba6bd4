// Helpers shared by kvpool's CPU kernels: bf16 conversion and an exp the compiler can vectorize.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVPOOL_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVPOOL_AVX2_F32 1  // the fp32 kernels' vector paths (8-lane FMA)
#endif

namespace kvpool_kernels {

// Error messages, assembled as plain strings: numbers through std::to_string, dtypes through c10::toString.
// TORCH_CHECK would stream its arguments into an ostringstream, and streaming a number into one from this
// library killed the process with a segfault on an H100 host (torch 2.11+cu130, g++ 13.3: the stream's
// num_put facet lookup jumped into std::codecvt), so a bad block id was a crash instead of a RuntimeError.
// Strings alone never touch a locale facet. KV_CHECK is the one check every kernel uses.
inline void append_to(std::string& s, std::string_view v) { s.append(v); }
inline void append_to(std::string& s, const char* v) { s.append(v); }
inline void append_to(std::string& s, c10::ScalarType t) { s.append(c10::toString(t)); }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append_to(std::string& s, T v) {
  s.append(std::to_string(v));
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (append_to(s, args), ...);
  return s;
}

#define KV_CHECK(cond, ...) TORCH_CHECK(cond, ::kvpool_kernels::message(__VA_ARGS__))

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Grouped decode attention in fp32 (decode_attention.cpp): sequences [first, first + count) of a group
// sharing their first `shared` keys, kv head h; see paged_decode_grouped in prefill_attention.cpp.
void decode_group_f32(const float* q, float* out, const float* k_cache, const float* v_cache, int64_t heads,
                      int64_t dim, int64_t h, int64_t s_head, int64_t s_block, int64_t s_token, int64_t block_size,
                      const int64_t* tables, int64_t width, const int64_t* lens, const int64_t* rows, int64_t first,
                      int64_t count, int64_t shared, int64_t group, float scale);

// Prompt attention in fp32 (prefill_f32.cpp), run by paged_prefill_attention (prefill_attention.cpp) after
// its checks. q and out: (rows, heads, dim); k and v: one layer's (kv_heads, blocks, block_size, dim) pages,
// of fp32 or (a narrower KV cache under an fp32 model) bf16, fp16 or fp8 elements, widened to fp32 as they are
// loaded.
enum class KvElem : int8_t { kFloat, kBFloat16, kHalf, kFloat8E4M3, kFloat8E5M2 };

// Whether an fp32 model's KV cache may hold `t` (kv_cache_dtype: the fp32 kernels read and write it).
inline bool narrow_kv(c10::ScalarType t) {
  return t == c10::kBFloat16 || t == c10::kHalf || t == c10::kFloat8_e4m3fn || t == c10::kFloat8_e5m2;
}

inline KvElem kv_elem_of(c10::ScalarType t) {
  switch (t) {
    case c10::kBFloat16: return KvElem::kBFloat16;
    case c10::kHalf: return KvElem::kHalf;
    case c10::kFloat8_e4m3fn: return KvElem::kFloat8E4M3;
    case c10::kFloat8_e5m2: return KvElem::kFloat8E5M2;
    default: return KvElem::kFloat;
  }
}

// fn(ElemOf<C>{}) for the element type C that `e` names (C++17 lambdas: `[&](auto t) { using C = typename
// decltype(t)::type; ... }`): the one switch of every op that reads or writes a narrowed cache.
template <typename C>
struct ElemOf {
  using type = C;
};
template <typename Fn>
decltype(auto) with_kv_elem(KvElem e, Fn&& fn) {
  switch (e) {
    case KvElem::kBFloat16: return fn(ElemOf<c10::BFloat16>{});
    case KvElem::kHalf: return fn(ElemOf<c10::Half>{});
    case KvElem::kFloat8E4M3: return fn(ElemOf<c10::Float8_e4m3fn>{});
    case KvElem::kFloat8E5M2: return fn(ElemOf<c10::Float8_e5m2>{});
    default: return fn(ElemOf<float>{});
  }
}

struct PagedF32 {
  const float* q;
  float* out;
  const void* k;
  const void* v;
  int64_t heads, group, dim, s_head, s_block, s_token, block_size;
  float scale;
  bool packed;    // keys stored as [dim][8] per 8 tokens (write_kv_packed), values in rows
  KvElem kv_elem;  // what the pages hold

  // Offset of query head g of kv head h in row `row` of q and out.
  int64_t at(int64_t row, int64_t h, int64_t g) const { return (row * heads + h * group + g) * dim; }
  // kv head h's keys and values, as elements of type C (the pages' own: float, c10::BFloat16, c10::Half or
  // an fp8 type).
  template <typename C>
  const C* keys(int64_t h) const { return static_cast<const C*>(k) + h * s_head; }
  template <typename C>
  const C* values(int64_t h) const { return static_cast<const C*>(v) + h * s_head; }
};
constexpr int64_t kPrefillF32Rows = 96;  // rows (query position x query head of the group) of one task
bool prefill_f32_supported(int64_t dim, int64_t block_size);
// Queries [first, first + count) of a sequence whose q_len queries are rows [q_start, q_start + q_len) and
// the last q_len of its ctx keys (read through `table`), for kv head h; window > 0: each query sees that
// many most recent positions, itself included.
void prefill_f32_task(const PagedF32& pg, const int64_t* table, int64_t q_start, int64_t q_len, int64_t ctx,
                      int64_t h, int64_t first, int64_t count, int64_t window);
// Decode rows on the same kernel (where prefill_f32_supported): sequences [first, first + count) of a group
// sharing their first `shared` keys, kv head h; row_of[b] is sequence b's row of q and out.
void decode_group_f32_rows(const PagedF32& pg, const int64_t* tables, int64_t width, const int64_t* lens,
                           const int64_t* row_of, int64_t h, int64_t first, int64_t count, int64_t shared);

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their running maximum), in a form the compiler vectorizes: no libm
// call. 2^n from the exponent bits times a degree-6 polynomial on [-ln2/2, ln2/2]: relative error
// about 2e-7, below fp32 rounding of the softmax sums it feeds.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows fp32 anyway; keeps 2^n a normal number
  const float n = __builtin_floorf(x * kLog2e + 0.5f);
  const float y = x - n * kLn2;
  float p = 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef KVPOOL_AVX2_F32
// exp_nonpositive on eight lanes (common.h's polynomial; n rounded to nearest rather than floor(x + 0.5)).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 y = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2), x);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

#ifdef KVPOOL_AVX512_BF16
// exp_nonpositive on sixteen lanes.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2), x);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 2^t for t <= 0 on sixteen lanes: the attention kernels keep scores in base-2 units (scaled by log2(e)
// once, with the softmax scale), which leaves exp's range reduction one rounding and one subtraction.
// 2^round(t) by vscalefps times a degree-5 polynomial for 2^f on [-1/2, 1/2] (coefficients fitted for
// relative error, ~2.4e-7 in fp32: fp32 rounding). Clamped at -126, so 2^n is never subnormal and a
// masked lane's -inf gives a tiny number (that the caller zeroes) rather than NaN.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3276358e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6755028e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507131e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001f));
  return _mm512_scalef_ps(p, n);
}

// 2^t for one t <= 0, by the same arithmetic as the sixteen-lane form.
inline float exp2_nonpositive(float t) { return _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps(t))); }
#endif

}  // namespace kvpool_kernels
