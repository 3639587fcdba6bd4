// Paged decode attention on the CPU: one query token per sequence, keys and values read in place
// through the sequence's block table, so nothing is gathered or copied. Each (sequence, kv head) is
// one task: its query heads share every key and value load, and an online softmax in fp32 keeps one
// pass over the context. Built at first use by kvpool/runner/kernels/__init__.py; the pure-torch path
// in kvpool/runner/attention.py computes the same thing when this library is missing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using namespace kvpool_kernels;

constexpr int64_t kMaxGroup = 16;   // query heads per kv head
constexpr int64_t kMaxDim = 256;    // head_dim
constexpr int64_t kMaxBlock = 256;  // tokens per block
#ifdef KVPOOL_AVX512_BF16
// Sixteen vectors of partial sums -> one vector holding their sixteen totals, in order: a transpose
// folded into the additions, so no horizontal sum runs per key.
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of up to 16 bf16 keys against the group's bf16 queries with the bf16 dot-product
// instruction (exact products, fp32 sums), scaled: scores[g][0..n).
template <int64_t DIM>
inline void scores_bf16(const c10::BFloat16* q, const c10::BFloat16* keys, int64_t n, int64_t s_token,
                        int64_t group, float scale, float (*scores)[kMaxBlock], int64_t col) {
  static_assert(DIM % 32 == 0, "whole 32-element bf16 vectors");
  constexpr int64_t kChunks = DIM / 32;
  __m512i kv[16][kChunks];
  for (int64_t t = 0; t < 16; ++t) {
    for (int64_t c = 0; c < kChunks; ++c) {
      kv[t][c] = t < n ? _mm512_loadu_si512(keys + t * s_token + c * 32) : _mm512_setzero_si512();
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    __m512i qv[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) qv[c] = _mm512_loadu_si512(q + g * DIM + c * 32);
    __m512 acc[16];
    for (int64_t t = 0; t < 16; ++t) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < kChunks; ++c) a = _mm512_dpbf16_ps(a, (__m512bh)qv[c], (__m512bh)kv[t][c]);
      acc[t] = a;
    }
    alignas(64) float tile[16];
    _mm512_store_ps(tile, _mm512_mul_ps(sum16(acc), vscale));
    for (int64_t t = 0; t < n; ++t) scores[g][col + t] = tile[t];
  }
}
#endif

#ifdef KVPOOL_AVX2_F32
// Eight vectors of partial sums -> one vector of their eight totals, in order (sum16's AVX2 twin).
inline __m256 sum8(const __m256* v) {
  const __m256 x0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 x1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(x0, x1, 0x20), _mm256_permute2f128_ps(x0, x1, 0x31));
}

// Scores of up to 8 fp32 keys against the group's scaled fp32 queries `qf`: scores[g][col..col+n).
// Without it the generic loop below sums each score in one dependent chain of scalar FMAs (the compiler
// may not reorder a float sum), which left decode attention several times slower on AVX2-only CPUs.
template <int64_t DIM>
inline void scores_f32(const float (*qf)[kMaxDim], const float* keys, int64_t n, int64_t s_token, int64_t group,
                       float (*scores)[kMaxBlock], int64_t col) {
  static_assert(DIM % 8 == 0, "whole 8-element vectors");
  constexpr int64_t kChunks = DIM / 8;
  for (int64_t g = 0; g < group; ++g) {
    __m256 acc[8];
    for (int64_t t = 0; t < 8; ++t) {
      __m256 a = _mm256_setzero_ps();
      if (t < n) {
        for (int64_t c = 0; c < kChunks; ++c) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(qf[g] + c * 8), _mm256_loadu_ps(keys + t * s_token + c * 8), a);
        }
      }
      acc[t] = a;
    }
    alignas(32) float tile[8];
    _mm256_store_ps(tile, sum8(acc));
    for (int64_t t = 0; t < n; ++t) scores[g][col + t] = tile[t];
  }
}

// One online-softmax step of a query head over its n new scores (replaced by their weights): the new
// maximum, and the sum of the weights. The generic loops below are scalar (a float max or sum is a
// reduction the compiler may not reorder), and they were most of a decode row's time on AVX2.
inline float softmax_step8(float* p, int64_t n, float m_old, float* sum_out) {
  int64_t t = 0;
  __m256 vm = _mm256_set1_ps(m_old);
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(p + t));
  float mx = hmax8(vm);
  for (; t < n; ++t) mx = std::max(mx, p[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vs = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + t), vmx));
    _mm256_storeu_ps(p + t, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = hsum8(vs);
  for (; t < n; ++t) {
    p[t] = exp_nonpositive(p[t] - mx);
    sum += p[t];
  }
  *sum_out = sum;
  return mx;
}
#endif

// One decode row's query heads of one kv head, mid-way through an online softmax: the scaled queries,
// the running maximum m, sum l and weighted values acc of every query head. A row is fed its keys block
// by block (`attend_keys`) and read out once (`finish`); the grouped path feeds a block to every row of a
// group while it is in L1, so keys shared by the group are read from memory once.
struct RowState {
  float (*qf)[kMaxDim];
  float (*acc)[kMaxDim];
  float* m;
  float* l;
};

template <typename T>
void start_row(const RowState& st, const T* q, int64_t group, int64_t dim, float scale) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) {
      st.qf[g][d] = to_float(q[g * dim + d]) * scale;
      st.acc[g][d] = 0.0f;
    }
    st.m[g] = -1e30f;
    st.l[g] = 0.0f;
  }
}

// n (<= kMaxBlock) consecutive keys and values at kb, vb, s_token elements apart. DIM > 0 fixes head_dim
// at compile time, so the loops over it unroll into whole vector registers; DIM == 0 is the generic fallback.
template <typename T, int64_t DIM>
void attend_keys(const RowState& st, const T* q, const T* kb, const T* vb, int64_t n, int64_t s_token,
                 int64_t group, int64_t runtime_dim, float scale) {
  const int64_t dim = DIM > 0 ? DIM : runtime_dim;
  alignas(64) float p[kMaxGroup][kMaxBlock];
  alignas(64) float row[kMaxDim];
  (void)q;
  (void)scale;
#ifdef KVPOOL_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16> && DIM > 0 && DIM % 32 == 0) {
    for (int64_t t = 0; t < n; t += 16) {
      scores_bf16<DIM>(q, kb + t * s_token, std::min<int64_t>(16, n - t), s_token, group, scale, p, t);
    }
  } else
#endif
#ifdef KVPOOL_AVX2_F32
  if constexpr (std::is_same_v<T, float> && DIM > 0 && DIM % 8 == 0) {
    for (int64_t t = 0; t < n; t += 8) {
      scores_f32<DIM>(st.qf, kb + t * s_token, std::min<int64_t>(8, n - t), s_token, group, p, t);
    }
  } else
#endif
  {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t d = 0; d < dim; ++d) row[d] = to_float(kb[t * s_token + d]);
      for (int64_t g = 0; g < group; ++g) {
        float s = 0.0f;
        for (int64_t d = 0; d < dim; ++d) s += st.qf[g][d] * row[d];
        p[g][t] = s;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float mx = st.m[g];
    float sum = 0.0f;
#ifdef KVPOOL_AVX2_F32
    if constexpr (std::is_same_v<T, float>) {
      mx = softmax_step8(p[g], n, mx, &sum);
    } else
#endif
    {
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, p[g][t]);
      for (int64_t t = 0; t < n; ++t) {
        p[g][t] = exp_nonpositive(p[g][t] - mx);
        sum += p[g][t];
      }
    }
    const float alpha = exp_nonpositive(st.m[g] - mx);
    st.l[g] = st.l[g] * alpha + sum;
    st.m[g] = mx;
    for (int64_t d = 0; d < dim; ++d) st.acc[g][d] *= alpha;
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < dim; ++d) row[d] = to_float(vb[t * s_token + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = p[g][t];
      for (int64_t d = 0; d < dim; ++d) st.acc[g][d] += w * row[d];
    }
  }
}

template <typename T>
void finish_row(const RowState& st, T* out, int64_t group, int64_t dim) {
  for (int64_t g = 0; g < group; ++g) {
    // Every row saw at least one key (its own query's), so l > 0.
    const float inv = 1.0f / st.l[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(st.acc[g][d] * inv);
  }
}

// Blocks are scattered, so the hardware prefetcher cannot see the next one coming: ask for it while this
// one computes.
template <typename T>
inline void prefetch_block(const T* k, const T* v, int64_t block_size, int64_t s_token, int64_t dim) {
  const char* nk = reinterpret_cast<const char*>(k);
  const char* nv = reinterpret_cast<const char*>(v);
  for (int64_t t = 0; t < block_size; ++t) {
    for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) {
      __builtin_prefetch(nk + t * s_token * sizeof(T) + off);
      __builtin_prefetch(nv + t * s_token * sizeof(T) + off);
    }
  }
}

// Keys [lo, len) of one sequence's blocks, from block table `table`, into a started row.
template <typename T, int64_t DIM>
void attend_range(const RowState& st, const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t lo, int64_t len, int64_t group, int64_t dim, int64_t block_size, int64_t s_block,
                  int64_t s_token, float scale) {
  for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
    const int64_t block = table[start / block_size];
    const int64_t t0 = std::max(lo, start) - start;
    const int64_t t1 = std::min(len, start + block_size) - start;
    if (start + block_size < len) {
      const int64_t next = table[start / block_size + 1];
      prefetch_block(k_cache + next * s_block, v_cache + next * s_block, block_size, s_token, dim);
    }
    attend_keys<T, DIM>(st, q, k_cache + block * s_block + t0 * s_token, v_cache + block * s_block + t0 * s_token,
                        t1 - t0, s_token, group, dim, scale);
  }
}

template <typename T, int64_t DIM>
void decode_one(const T* q, T* out, const T* k_cache, const T* v_cache, const int64_t* table, int64_t lo,
                int64_t len, int64_t group, int64_t runtime_dim, int64_t block_size, int64_t s_block,
                int64_t s_token, float scale) {
  const int64_t dim = DIM > 0 ? DIM : runtime_dim;
  alignas(64) float qf[kMaxGroup][kMaxDim];
  alignas(64) float acc[kMaxGroup][kMaxDim];
  float m[kMaxGroup];
  float l[kMaxGroup];
  const RowState st{qf, acc, m, l};
  start_row(st, q, group, dim, scale);
  attend_range<T, DIM>(st, q, k_cache, v_cache, table, lo, len, group, dim, block_size, s_block, s_token, scale);
  finish_row(st, out, group, dim);
}

// Decode rows of fp32 sequences in groups sharing their first shared[i] keys (see paged_decode_grouped in
// prefill_attention.cpp, whose checks this runs after): one task per (group, kv head) feeds each shared
// block to all of the group's rows while it is in L1, then each row its own keys. A row's arithmetic is
// the same as decode_one's, block for block, so grouping changes no bit of the result.
template <int64_t DIM>
void decode_group_f32_task(const float* q, float* out, const float* k_cache, const float* v_cache, int64_t heads,
                      int64_t runtime_dim, int64_t h, int64_t s_block, int64_t s_token, int64_t block_size,
                      const int64_t* tables, int64_t width, const int64_t* lens, const int64_t* rows, int64_t first,
                      int64_t count, int64_t shared, int64_t group, float scale) {
  const int64_t dim = DIM > 0 ? DIM : runtime_dim;
  std::vector<float> qf(count * group * kMaxDim), acc(count * group * kMaxDim), m(count * group), l(count * group);
  std::vector<RowState> st;
  st.reserve(count);
  for (int64_t r = 0; r < count; ++r) {
    st.push_back({reinterpret_cast<float(*)[kMaxDim]>(qf.data() + r * group * kMaxDim),
                  reinterpret_cast<float(*)[kMaxDim]>(acc.data() + r * group * kMaxDim), m.data() + r * group,
                  l.data() + r * group});
    start_row(st[r], q + (rows[first + r] * heads + h * group) * dim, group, dim, scale);
  }
  const int64_t* table = tables + first * width;
  for (int64_t j = 0; j < shared / block_size; ++j) {
    const float* kb = k_cache + table[j] * s_block;
    const float* vb = v_cache + table[j] * s_block;
    if (j + 1 < shared / block_size) {
      prefetch_block(k_cache + table[j + 1] * s_block, v_cache + table[j + 1] * s_block, block_size, s_token, dim);
    }
    for (int64_t r = 0; r < count; ++r) {
      attend_keys<float, DIM>(st[r], nullptr, kb, vb, block_size, s_token, group, dim, scale);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t b = first + r;
    attend_range<float, DIM>(st[r], nullptr, k_cache, v_cache, tables + b * width, shared, lens[b], group, dim,
                             block_size, s_block, s_token, scale);
    finish_row(st[r], out + (rows[b] * heads + h * group) * dim, group, dim);
  }
}

template <typename T>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& tables, const at::Tensor& lows, const at::Tensor& lens, double scale,
                at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t width = tables.size(1);
  const T* qp = q.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lo = lows.const_data_ptr<int64_t>();
  const int64_t* ln = lens.const_data_ptr<int64_t>();
  const int64_t s_head = k_cache.stride(0), s_block = k_cache.stride(1), s_token = k_cache.stride(2);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      const int64_t offset = (b * heads + h * group) * dim;
      auto* fn = dim == 64 ? &decode_one<T, 64> : dim == 128 ? &decode_one<T, 128> : &decode_one<T, 0>;
      fn(qp + offset, op + offset, kp + h * s_head, vp + h * s_head, tp + b * width, lo[b], ln[b], group, dim,
         block_size, s_block, s_token, static_cast<float>(scale));
    }
  });
}

// q: (B, heads, D); k_cache, v_cache: (kv_heads, blocks, block_size, D), D contiguous; tables: (B, W)
// int64 block ids; sequence b attends to positions [lows[b], lens[b]) of the blocks its table lists.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lows, const at::Tensor& lens,
                                  double scale, at::Tensor out) {
  KV_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous (B, heads, head_dim) tensor");
  KV_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous and shaped and typed like q");
  KV_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must share one (kv_heads, blocks, block_size, head_dim) layout");
  KV_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share one dtype");
  KV_CHECK(k_cache.stride(3) == 1, "head_dim must be the caches' innermost, contiguous dimension");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(0);
  KV_CHECK(k_cache.size(3) == dim, "q and the caches disagree on head_dim");
  KV_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "heads / kv_heads must be a whole number <= ",
              kMaxGroup);
  KV_CHECK(dim <= kMaxDim && k_cache.size(2) <= kMaxBlock, "head_dim <= ", kMaxDim, " and block_size <= ",
              kMaxBlock, " only");
  KV_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous(), "tables must be a contiguous int64 (B, W) tensor");
  KV_CHECK(lows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && lows.is_contiguous() &&
                  lens.is_contiguous() && lows.numel() == q.size(0) && lens.numel() == q.size(0),
              "lows and lens must be contiguous int64 (B,) tensors");
  const int64_t* lo = lows.const_data_ptr<int64_t>();
  const int64_t* ln = lens.const_data_ptr<int64_t>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t width = tables.size(1), block_size = k_cache.size(2), blocks = k_cache.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {
    KV_CHECK(0 <= lo[b] && lo[b] < ln[b] && ln[b] <= width * block_size, "sequence ", b, ": keys [", lo[b],
                ", ", ln[b], ") do not fit its ", width, " blocks");
    // Out-of-range ids would read outside the caches: refuse them here rather than fault mid-kernel.
    for (int64_t j = lo[b] / block_size; j <= (ln[b] - 1) / block_size; ++j) {
      KV_CHECK(0 <= tp[b * width + j] && tp[b * width + j] < blocks, "sequence ", b, ": block id ",
                  tp[b * width + j], " is outside the cache's ", blocks, " blocks");
    }
  }
  if (q.scalar_type() == at::kFloat) {
    decode_all<float>(q, k_cache, v_cache, tables, lows, lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_all<c10::BFloat16>(q, k_cache, v_cache, tables, lows, lens, scale, out);
  } else {
    KV_CHECK(false, "paged_decode_attention: float32 and bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

namespace kvpool_kernels {

void decode_group_f32(const float* q, float* out, const float* k_cache, const float* v_cache, int64_t heads,
                      int64_t dim, int64_t h, int64_t s_head, int64_t s_block, int64_t s_token, int64_t block_size,
                      const int64_t* tables, int64_t width, const int64_t* lens, const int64_t* rows, int64_t first,
                      int64_t count, int64_t shared, int64_t group, float scale) {
  auto* fn = dim == 64 ? &decode_group_f32_task<64> : dim == 128 ? &decode_group_f32_task<128>
           : dim == 256 ? &decode_group_f32_task<256> : &decode_group_f32_task<0>;
  fn(q, out, k_cache + h * s_head, v_cache + h * s_head, heads, dim, h, s_block, s_token, block_size, tables, width,
     lens, rows, first, count, shared, group, scale);
}

}  // namespace kvpool_kernels

TORCH_LIBRARY(kvpool, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lows, "
        "Tensor lens, float scale, Tensor(a!) out) -> Tensor(a!)");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
