// Paged prompt attention in fp32 on CPUs with AVX2 and FMA: the bf16 prefill kernel's design
// (prefill_attention.cpp) in 8-lane fp32 vectors. Flash attention whose keys and values are read in place
// through the sequence's block table; causal and sliding-window masks come from positions, so there is
// no bias tensor, no gather and no cascade split.
//
// A prompt task is (sequence, kv head, up to 96 rows: query positions times the kv head's query heads),
// so every key and value loaded serves all of them; a decode task is (group of sequences sharing a prefix,
// kv head): all their rows read the shared keys together, then each sequence its own. Keys come 8 to a
// tile, 16 to a pass, at positions that are multiples of 16. A pass's keys are transposed (kt[d] = element
// d of a tile's 8 keys) once for all rows, or stored that way in packed caches (write_kv_packed), so that
// a score block is broadcast(query element) x key vector FMAs: up to 6 rows x 2 tiles = 12 sums in flight,
// each query element loaded serving 16 keys, each key vector 6 rows. The online softmax (natural base,
// common.h's exp) then moves pass by pass per row, and the value products add p x value rows (read in
// place, head_dim contiguous) for 4 rows x 2 vectors at a time.
//
// A row's own arithmetic never depends on which rows or tiles share a call: its score for a key is one
// FMA chain over head_dim from zero; its softmax and value sums go pass by pass at fixed positions, and a
// key a row does not see changes nothing (weight exactly 0, never a rescale). That is what keeps fp32
// tokens identical with prefix caching on or off and at any chunk size, as the bf16 kernel's are.
//
// The pages may hold bf16, fp16 or fp8 keys and values instead (`kv_cache_dtype` under an fp32 model): a
// load then widens 8 of them to fp32 exactly (a bf16 is the top half of an fp32; fp16 through F16C, fp8
// through fp16), once per pass where several row groups read them (Rows::attend), and the arithmetic is the
// same; the queries, sums and outputs stay fp32. Half (a quarter) of the bytes per key is what a decode step
// streams.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "common.h"

namespace kvpool_kernels {

bool prefill_f32_supported(int64_t dim, int64_t block_size) {
#ifdef KVPOOL_AVX2_F32
  return (dim == 64 || dim == 128 || dim == 256) && block_size % 8 == 0 && block_size <= 256;
#else
  (void)dim;
  (void)block_size;
  return false;
#endif
}

}  // namespace kvpool_kernels

#ifdef KVPOOL_AVX2_F32
namespace {

using namespace kvpool_kernels;

constexpr int64_t kTile = 8;        // keys per tile: one vector of scores
constexpr int64_t kPassTiles = 2;   // tiles whose keys one pass transposes and scores together
constexpr int64_t kRowBlock = 6;    // rows whose scores are computed together (6 x 2 tiles = 12 sums)
constexpr int64_t kPvRows = 4;      // rows whose value sums share each value vector loaded (x 2 vectors)
constexpr int64_t kMaxRows = kPrefillF32Rows;

// The 8 x 8 matrix in r (row i: r[i]), transposed in place.
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// 8 consecutive elements of a page, as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename C>
inline __m256 load8_scalar(const C* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
}
inline __m256 load8(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return load8_scalar(p);
#endif
}
// fp8 e5m2 is the top byte of an fp16: each byte becomes the high half of a 16-bit lane, then F16C widens it.
inline __m256 load8(const c10::Float8_e5m2* p) {
#ifdef __F16C__
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
#else
  return load8_scalar(p);
#endif
}
// fp8 e4m3: its exponent and mantissa bits shifted into an fp16's places read as the value times 2^-8 (fp16's
// exponent bias is 15, e4m3's 7), subnormals included (they are fp16 subnormals there too); times 256 is
// exact. The shift is one arithmetic shift of the byte at the top of its 16-bit lane, which copies the sign
// into bit 14 as well; the mask clears that copy. e4m3fn has no infinities: its NaN (0x7f, 0xff: every
// exponent and mantissa bit set) would read as 480, so those lanes become an fp16 NaN instead (kvpool's
// saturating writes store it only from a NaN).
inline __m256 load8(const c10::Float8_e4m3fn* p) {
#ifdef __F16C__
  const __m128i top = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i bits = _mm_set1_epi16(0x7f00);
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(top, bits), bits);
  const __m128i half = _mm_and_si128(_mm_srai_epi16(top, 1), _mm_set1_epi16(static_cast<int16_t>(0xbfff)));
  const __m128i fp16 = _mm_blendv_epi8(half, _mm_set1_epi16(0x7e00), nan);
  return _mm256_mul_ps(_mm256_cvtph_ps(fp16), _mm256_set1_ps(256.0f));
#else
  return load8_scalar(p);
#endif
}

constexpr int64_t kPass = kTile * kPassTiles;  // keys per pass, at positions that are multiples of kPass
constexpr int64_t kAhead = 2;                    // passes whose keys are asked for before they are read

// Keys [lo, hi) of one sequence, read through its block table.
struct KeySpan {
  const int64_t* table;
  int64_t lo, hi;

  // Asks for kv head h's keys and values of passes [j, j + count) of the span to be brought into cache,
  // every 64-byte line of them (pages of C elements).
  template <typename C>
  void ask(const PagedF32& pg, int64_t h, int64_t j, int64_t count) const {
    const C* k = pg.keys<C>(h);
    const C* v = pg.values<C>(h);
    const int64_t first = lo - lo % kPass;
    for (int64_t t0 = first + j * kPass; count > 0 && t0 < hi; t0 += kPass, --count) {
      for (int64_t t = std::max(t0, lo); t < std::min(t0 + kPass, hi); ++t) {
        const int64_t at = table[t / pg.block_size] * pg.s_block + (t % pg.block_size) * pg.s_token;
        for (int64_t d = 0; d < pg.dim; d += 64 / static_cast<int64_t>(sizeof(C))) {
          __builtin_prefetch(k + at + d);
          __builtin_prefetch(v + at + d);
        }
      }
    }
  }
};

template <int64_t DIM, typename C>
struct Rows {
  static constexpr int64_t kChunks = DIM / 8;
  alignas(32) float q[kMaxRows][DIM];    // the rows' queries, times the softmax scale
  alignas(32) float acc[kMaxRows][DIM];  // their weighted value sums
  alignas(32) float kt[kPassTiles][DIM][kTile];  // the pass's keys, transposed here (standard caches)
  const float (*keys_t[kPassTiles])[kTile] = {};  // the pass's transposed keys: kt ...
  const C (*keys_p[kPassTiles])[kTile] = {};      // ... or in place (packed caches)
  // A narrower cache's values of the pass, widened once where several row groups read them (see attend).
  alignas(32) float vt[kPass][DIM];
  alignas(32) float sc[kMaxRows][kPassTiles * kTile];  // the pass's scores, then weights
  float m[kMaxRows], l[kMaxRows];        // running maximum and weight sum per row
  int64_t pos[kMaxRows], low[kMaxRows];  // the keys a row sees: [low, pos]
  int64_t n = 0;

  // sc[r + i][8u + t] for rows [r, r + N) and the pass's NT tiles (transposed keys of K elements: kt's
  // fp32, or a packed page's own): each sum one FMA chain over head_dim.
  template <int64_t N, int64_t NT, typename K>
  inline void scores(int64_t r, const K (*const* tiles)[kTile]) {
    __m256 a[N][NT];
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t u = 0; u < NT; ++u) a[i][u] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < DIM; ++d) {
      __m256 k[NT];
      for (int64_t u = 0; u < NT; ++u) k[u] = load8(tiles[u][d]);
      for (int64_t i = 0; i < N; ++i) {
        const __m256 qi = _mm256_broadcast_ss(&q[r + i][d]);
        for (int64_t u = 0; u < NT; ++u) a[i][u] = _mm256_fmadd_ps(qi, k[u], a[i][u]);
      }
    }
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t u = 0; u < NT; ++u) _mm256_store_ps(sc[r + i] + kTile * u, a[i][u]);
    }
  }

  template <int64_t NT, typename K>
  inline void scores_rows(int64_t r, int64_t count, const K (*const* tiles)[kTile]) {
    switch (count) {
      case 1: scores<1, NT>(r, tiles); break;
      case 2: scores<2, NT>(r, tiles); break;
      case 3: scores<3, NT>(r, tiles); break;
      case 4: scores<4, NT>(r, tiles); break;
      case 5: scores<5, NT>(r, tiles); break;
      default: scores<kRowBlock, NT>(r, tiles); break;
    }
  }

  template <int64_t NT>
  inline void scores_rows(int64_t r, int64_t count, bool packed) {
    if (packed) {
      scores_rows<NT>(r, count, keys_p);
    } else {
      scores_rows<NT>(r, count, keys_t);
    }
  }

  // acc[rows[i]] += sum over the pass's keys t in [t0, t1), in order, of sc[rows[i]][t] x value t (at
  // vals[t]), for N rows: each value vector loaded serves them all.
  template <int64_t N, typename V>
  inline void add_values(const int64_t* rows, const V* const* vals, int64_t t0, int64_t t1) {
    constexpr int64_t kStep = 2;  // value vectors per row kept in registers
    for (int64_t c0 = 0; c0 < kChunks; c0 += kStep) {
      __m256 o[N][kStep];
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t c = 0; c < kStep; ++c) o[i][c] = _mm256_load_ps(acc[rows[i]] + 8 * (c0 + c));
      }
      for (int64_t t = t0; t < t1; ++t) {
        __m256 vv[kStep];
        for (int64_t c = 0; c < kStep; ++c) vv[c] = load8(vals[t] + 8 * (c0 + c));
        for (int64_t i = 0; i < N; ++i) {
          const __m256 p = _mm256_broadcast_ss(&sc[rows[i]][t]);
          for (int64_t c = 0; c < kStep; ++c) o[i][c] = _mm256_fmadd_ps(p, vv[c], o[i][c]);
        }
      }
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t c = 0; c < kStep; ++c) _mm256_store_ps(acc[rows[i]] + 8 * (c0 + c), o[i][c]);
      }
    }
  }

  // Row r's online-softmax step over the pass's keys [t0 + t_lo, t0 + t_hi): false if it sees none of them.
  // The weights replace the scores; a key the row does not see gets weight exactly 0.
  inline bool softmax_pass(int64_t r, int64_t t0, int64_t t_lo, int64_t t_hi) {
    const int64_t lo = std::max(low[r] - t0, t_lo), hi = std::min(pos[r] - t0, t_hi - 1);  // seen: [lo, hi]
    if (lo > hi) return false;
    __m256 s[kPassTiles], seen[kPassTiles];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mx8 = _mm256_set1_ps(m[r]);
    for (int64_t u = 0; u < kPassTiles; ++u) {
      const int64_t a = lo - kTile * u, b = hi - kTile * u;  // this tile's lanes seen: [a, b]
      if (b < 0 || a >= kTile) {
        s[u] = _mm256_set1_ps(-INFINITY);
        seen[u] = _mm256_setzero_ps();
        continue;
      }
      s[u] = _mm256_load_ps(sc[r] + kTile * u);
      seen[u] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      if (a > 0 || b < kTile - 1) {
        const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(a)), lane);
        const __m256i after = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(b)));
        seen[u] = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(before, after), _mm256_set1_epi32(-1)));
        s[u] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[u], seen[u]);
      }
      mx8 = _mm256_max_ps(mx8, s[u]);
    }
    const float mx = hmax8(mx8);
    if (mx > m[r]) {  // (an unchanged maximum would rescale by exp(0) = 1 exactly: skipping it changes no bit)
      const float alpha = exp_nonpositive(m[r] - mx);
      l[r] *= alpha;
      const __m256 va = _mm256_set1_ps(alpha);
      for (int64_t c = 0; c < kChunks; ++c) _mm256_store_ps(acc[r] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * c), va));
      m[r] = mx;
    }
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t u = 0; u < kPassTiles; ++u) {
      const __m256 p = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(s[u], vmx)), seen[u]);
      _mm256_store_ps(sc[r] + kTile * u, p);
      sum = _mm256_add_ps(sum, p);
    }
    l[r] += hsum8(sum);
    return true;
  }

  // A row for query `query` (DIM floats), which sees keys [first_visible, position].
  void add(const float* query, float scale, int64_t position, int64_t first_visible) {
    for (int64_t d = 0; d < DIM; ++d) {
      q[n][d] = query[d] * scale;
      acc[n][d] = 0.0f;
    }
    m[n] = -INFINITY;
    l[n] = 0.0f;
    pos[n] = position;
    low[n] = first_visible;
    ++n;
  }

  // Rows [row_begin, row_end) over the keys of `span` in kv head h's pages. A key a row does not see
  // ([low, pos]) changes nothing of it, so rows may share keys that only some see.
  //
  // Blocks are scattered, so no hardware prefetcher sees the next pass's keys coming: each pass asks for
  // the keys and values kAhead passes on, running into `next` (the keys the following call will read) near
  // the end. The caller asks for the first kAhead passes of the first call. A decode sequence's own keys
  // have only its query heads' rows to compute while the next ones arrive: asking ahead took a 64-row
  // grouped decode step (8 groups over 1,024 shared keys, 208 own keys per sequence, 30 layers, packed
  // keys) from 135-143 to 120-134 ms on an AVX2 EPYC.
  void attend(const PagedF32& pg, int64_t h, const KeySpan& span, int64_t row_begin, int64_t row_end,
              const KeySpan* next = nullptr) {
    const C* k = pg.keys<C>(h);
    const C* v = pg.values<C>(h);
    const int64_t* table = span.table;
    const int64_t key_lo = span.lo, key_hi = span.hi;
    int64_t live[kMaxRows];
    const int64_t first_pass = key_lo - key_lo % kPass;
    const int64_t n_pass = (key_hi - first_pass + kPass - 1) / kPass;
    // Passes at fixed positions (multiples of 16): a row's softmax moves pass by pass, so its result depends
    // on the keys alone, not on which rows or keys shared its task.
    for (int64_t t0 = first_pass, j = 0; t0 < key_hi; t0 += kPass, ++j) {
      if (j + kAhead < n_pass) {
        span.ask<C>(pg, h, j + kAhead, 1);
      } else if (next != nullptr) {
        next->ask<C>(pg, h, j + kAhead - n_pass, 1);
      }
      const int64_t nt = std::min<int64_t>(kPassTiles, (key_hi - t0 + kTile - 1) / kTile);
      const C* vals[kPass] = {};  // each key's values
      // The pass's keys that are read: [t_lo, t_hi). The others (before the window, past the context, another
      // call's) may hold NaN (unused slots, released blocks): their scores are masked, their values not loaded.
      const int64_t t_lo = std::max<int64_t>(key_lo - t0, 0), t_hi = std::min<int64_t>(key_hi - t0, kPass);
      // Keys [t0 + t_lo, t0 + t_hi) seen by some row: in a prompt tile rows' [low, pos] rise with the row,
      // so the rows left out at either end see none of them (in a decode group every row sees them all).
      int64_t r0 = row_begin, r1 = row_end;
      while (r0 < r1 && pos[r0] < t0 + t_lo) ++r0;
      while (r1 > r0 && low[r1 - 1] >= t0 + t_hi) --r1;
      // A narrower cache's packed keys are widened once into kt when more than one row block scores them
      // (a prompt task's 96 rows: 16), rather than at every block's loads; the same values, so the same bits.
      const bool widen = !std::is_same_v<C, float> && r1 - r0 > kRowBlock;
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t tu = t0 + kTile * u;  // a tile never straddles a block: block_size % 8 == 0
        const int64_t at = table[tu / pg.block_size] * pg.s_block + (tu % pg.block_size) * pg.s_token;
        for (int64_t t = 0; t < kTile; ++t) vals[kTile * u + t] = v + at + t * pg.s_token;
        if (pg.packed) {
          // In place: its keys outside [t_lo, t_hi) may be garbage (even NaN), but every row's softmax masks
          // their scores off, and their values are never read.
          keys_p[u] = reinterpret_cast<const C(*)[kTile]>(k + at);
          if (widen) {
            for (int64_t d = 0; d < DIM; ++d) _mm256_store_ps(kt[u][d], load8(keys_p[u][d]));
            keys_t[u] = kt[u];
          }
          continue;
        }
        const C* keys = k + at;
        for (int64_t c = 0; c < DIM / 8; ++c) {
          __m256 r[8];
          for (int64_t t = 0; t < kTile; ++t) {
            const int64_t key = kTile * u + t;
            r[t] = key >= t_lo && key < t_hi ? load8(keys + t * pg.s_token + 8 * c) : _mm256_setzero_ps();
          }
          transpose8(r);
          for (int64_t e = 0; e < 8; ++e) _mm256_store_ps(kt[u][8 * c + e], r[e]);
        }
        keys_t[u] = kt[u];
      }
      for (int64_t r = r0; r < r1; r += kRowBlock) {
        const int64_t rows = std::min<int64_t>(kRowBlock, r1 - r);
        if (nt == 2) {
          scores_rows<2>(r, rows, pg.packed && !widen);
        } else {
          scores_rows<1>(r, rows, pg.packed && !widen);
        }
      }
      int64_t n_live = 0;
      for (int64_t r = r0; r < r1; ++r) {
        if (softmax_pass(r, t0, t_lo, t_hi)) live[n_live++] = r;
      }
      if (!std::is_same_v<C, float> && n_live > kPvRows) {
        // Several groups of rows read each value vector: widen the seen keys' values once, as for the keys.
        const float* wide[kPass] = {};
        for (int64_t t = t_lo; t < t_hi; ++t) {
          for (int64_t c = 0; c < DIM / 8; ++c) _mm256_store_ps(vt[t] + 8 * c, load8(vals[t] + 8 * c));
          wide[t] = vt[t];
        }
        sum_values(live, n_live, wide, t_lo, t_hi);
      } else {
        sum_values(live, n_live, vals, t_lo, t_hi);
      }
    }
  }

  // add_values for the live rows, kPvRows at a time.
  template <typename V>
  inline void sum_values(const int64_t* live, int64_t n_live, const V* const* vals, int64_t t_lo, int64_t t_hi) {
    int64_t i = 0;
    for (; i + kPvRows <= n_live; i += kPvRows) add_values<kPvRows>(live + i, vals, t_lo, t_hi);
    if (n_live - i == 3) add_values<3>(live + i, vals, t_lo, t_hi);
    if (n_live - i == 2) add_values<2>(live + i, vals, t_lo, t_hi);
    if (n_live - i == 1) add_values<1>(live + i, vals, t_lo, t_hi);
  }

  void write(int64_t r, float* out) const {
    const float inv = 1.0f / l[r];  // every row sees at least its own key
    for (int64_t d = 0; d < DIM; ++d) out[d] = acc[r][d] * inv;
  }
};

// One prompt task: queries [first, first + count) of a sequence (rows from q_start on, the first at
// position pos0), for kv head h.
template <int64_t DIM, typename C>
void prompt_task(const PagedF32& pg, const int64_t* table, int64_t q_start, int64_t pos0, int64_t h, int64_t first,
                 int64_t count, int64_t window) {
  // ~2 x 96 x DIM floats of row state: on the heap, not on an OpenMP thread's stack.
  auto rows = std::make_unique<Rows<DIM, C>>();
  const int64_t group = pg.group;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = pos0 + i;
    for (int64_t g = 0; g < group; ++g) {
      rows->add(pg.q + pg.at(q_start + first + i, h, g), pg.scale, p, window > 0 ? std::max<int64_t>(0, p - window + 1) : 0);
    }
  }
  const KeySpan keys{table, rows->low[0], pos0 + count};
  keys.ask<C>(pg, h, 0, kAhead);
  rows->attend(pg, h, keys, 0, rows->n);
  for (int64_t r = 0; r < rows->n; ++r) rows->write(r, pg.out + pg.at(q_start + first + r / group, h, r % group));
}

// One decode task: single-query sequences [first, first + count) sharing their first `shared` keys (the
// same blocks), for kv head h: the shared keys are read once for all their rows, then each sequence's own.
template <int64_t DIM, typename C>
void decode_group_task(const PagedF32& pg, const int64_t* tables, int64_t width, const int64_t* lens,
                       const int64_t* row_of, int64_t h, int64_t first, int64_t count, int64_t shared) {
  auto rows = std::make_unique<Rows<DIM, C>>();
  const int64_t group = pg.group;
  for (int64_t b = first; b < first + count; ++b) {
    for (int64_t g = 0; g < group; ++g) rows->add(pg.q + pg.at(row_of[b], h, g), pg.scale, lens[b] - 1, 0);
  }
  const auto own = [&](int64_t b) { return KeySpan{tables + b * width, shared, lens[b]}; };
  KeySpan next = own(first);
  const KeySpan common{tables + first * width, 0, shared};
  common.ask<C>(pg, h, 0, kAhead);
  rows->attend(pg, h, common, 0, rows->n, &next);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t b = first + i;
    const KeySpan mine = next;
    next = b + 1 < first + count ? own(b + 1) : KeySpan{nullptr, 0, 0};
    rows->attend(pg, h, mine, i * group, (i + 1) * group, &next);
    for (int64_t g = 0; g < group; ++g) rows->write(i * group + g, pg.out + pg.at(row_of[b], h, g));
  }
}

// The task functions for head_dim 64, 128 or 256 (what prefill_f32_supported allows) and pages of C.
struct PromptTask {
  template <int64_t DIM, typename C>
  static constexpr auto fn = &prompt_task<DIM, C>;
};
struct DecodeTask {
  template <int64_t DIM, typename C>
  static constexpr auto fn = &decode_group_task<DIM, C>;
};
template <typename Task, typename C>
auto by_dim(int64_t dim) {
  return dim == 64 ? Task::template fn<64, C> : dim == 128 ? Task::template fn<128, C> : Task::template fn<256, C>;
}

}  // namespace
#endif

namespace kvpool_kernels {

void prefill_f32_task(const PagedF32& pg, const int64_t* table, int64_t q_start, int64_t q_len, int64_t ctx,
                      int64_t h, int64_t first, int64_t count, int64_t window) {
#ifdef KVPOOL_AVX2_F32
  const int64_t pos0 = ctx - q_len + first;  // position of the task's first query
  with_kv_elem(pg.kv_elem, [&](auto t) {
    by_dim<PromptTask, typename decltype(t)::type>(pg.dim)(pg, table, q_start, pos0, h, first, count, window);
  });
#else
  (void)pg, (void)table, (void)q_start, (void)q_len, (void)ctx, (void)h, (void)first, (void)count, (void)window;
#endif
}

void decode_group_f32_rows(const PagedF32& pg, const int64_t* tables, int64_t width, const int64_t* lens,
                           const int64_t* row_of, int64_t h, int64_t first, int64_t count, int64_t shared) {
#ifdef KVPOOL_AVX2_F32
  with_kv_elem(pg.kv_elem, [&](auto t) {
    by_dim<DecodeTask, typename decltype(t)::type>(pg.dim)(pg, tables, width, lens, row_of, h, first, count, shared);
  });
#else
  (void)pg, (void)tables, (void)width, (void)lens, (void)row_of, (void)h, (void)first, (void)count, (void)shared;
#endif
}

}  // namespace kvpool_kernels
