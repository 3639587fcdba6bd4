// Paged attention in bf16 on CPUs with AVX-512 BF16, for chunks of several queries (prefill) and for
// decode rows in groups sharing a prefix: flash attention whose keys and values are read in place
// through each sequence's block table, causal (and sliding-window) masks computed from positions, no
// bias tensor, no gather, no cascade split.
//
// A prompt task is (sequence, kv head, a tile of query positions); its rows are the tile's positions
// times the kv head's query heads, so every key and value loaded serves all of them. A decode task is
// (group of sequences, kv head): all their rows read the shared keys together, then each its own. Keys come 16 at a time:
// repacked into pairs along head_dim (keys) or along tokens (values), both products run on the bf16
// dot-product instruction (exact products, fp32 sums), with an online softmax in fp32 (base 2)
// between them.
// Probabilities are rounded to bf16 for the value product, as PyTorch's CPU flash kernel does.
//
// Register blocking: scores are computed for up to 8 rows against several tiles at once (8 rows x 2
// tiles, down to 3 rows x 8 tiles: each query value loaded serves 32-128 keys, 16-24 sums in flight), and
// value products for 3-4 rows at once (each value chunk loaded serves them all), so the loop is bound by
// the dot products rather than by loads or their latency. A row's own arithmetic (its scores, its
// softmax tile by tile, the order of its sums) never depends on which rows or tiles share a call: that is
// what keeps bf16 tokens identical with prefix caching on or off and at any chunk size.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using namespace kvpool_kernels;
using Bf16 = c10::BFloat16;

constexpr int64_t kMaxRows = 96;  // rows (query position x head of the group) of one task
// Rows whose scores are computed together against one pass's key tiles: 8 rows x 2 tiles measured ~5% faster
// than 12 x 2 (prompt chunks over a shared prefix, and grouped decode rows), with the same sums.
constexpr int64_t kRowBlock = 8;
constexpr int64_t kMaxTiles = 8;   // tiles of 16 keys read per pass (see Rows::tiles_for)
constexpr int64_t kAheadTiles = 8; // tiles asked for beyond the next pass (see Rows::attend's ask_tile)

struct Task {
  int64_t seq, head, first, count;  // prompt: queries [first, first + count) of sequence `seq`;
  int64_t cost;                     // decode: sequences [first, first + count) of group `seq`
};

struct Seq {
  int64_t q_start, q_len, ctx;  // rows of the step; keys in the cache, the queries' own included
  const int64_t* table;
};

// What every task reads and writes: the rows' queries and outputs ((rows, heads, D) bf16) and one
// layer's paged caches ((kv_heads, blocks, block_size, D), D contiguous).
struct Paged {
  const Bf16* q;
  Bf16* out;
  const Bf16* k;
  const Bf16* v;
  int64_t heads, group, s_head, s_block, s_token, block_size;
  float scale;
  bool packed;  // the caches hold every 16 tokens' keys and values as the kernel reads them (see write_kv_packed)

  Paged(const at::Tensor& q_, at::Tensor& out_, const at::Tensor& k_cache, const at::Tensor& v_cache, double sc,
        bool packed_)
      : q(q_.const_data_ptr<Bf16>()), out(out_.mutable_data_ptr<Bf16>()), k(k_cache.const_data_ptr<Bf16>()),
        v(v_cache.const_data_ptr<Bf16>()), heads(q_.size(1)), group(q_.size(1) / k_cache.size(0)),
        s_head(k_cache.stride(0)), s_block(k_cache.stride(1)), s_token(k_cache.stride(2)),
        block_size(k_cache.size(2)), scale(static_cast<float>(sc)), packed(packed_) {}

  // Offset of query head g of kv head h in row `row` of q and out.
  int64_t at(int64_t row, int64_t h, int64_t g, int64_t dim) const { return (row * heads + h * group + g) * dim; }
};

#ifdef KVPOOL_AVX512_BF16

// The 16 x 16 int32 matrix in rows r, transposed in place: four rounds of shuffles, no scalar moves.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: rows 4i..4i+3 at column 4L + j
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a_lo = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), a_hi = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i b_lo = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i b_hi = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(a_lo, b_lo, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(a_lo, b_lo, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(a_hi, b_hi, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(a_hi, b_hi, 0xDD);
  }
}

// Sixteen keys (rows of DIM bf16, s_token apart) into kp[p][t] = key t's elements 2p, 2p + 1; keys
// outside [lo, hi) become zeros, so garbage in unused slots (even NaN) cannot reach a sum.
template <int64_t DIM>
inline void pack_keys(const Bf16* keys, int64_t s_token, int64_t lo, int64_t hi, int32_t (*kp)[16]) {
  for (int64_t c = 0; c < DIM / 32; ++c) {  // 16 pairs of each key at a time
    __m512i r[16];
    for (int64_t t = 0; t < 16; ++t) {
      r[t] = t >= lo && t < hi ? _mm512_loadu_si512(keys + t * s_token + 32 * c) : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(kp[16 * c + p], r[p]);
  }
}

// Sixteen values into vp[j][d] = element d of values 2j (low half) and 2j + 1 (high half), zeros
// outside [lo, hi) as above.
template <int64_t DIM>
inline void pack_values(const Bf16* values, int64_t s_token, int64_t lo, int64_t hi, int32_t (*vp)[DIM]) {
  // Output int32 i of a 16-lane chunk pairs element i of the first row with element i of the second.
  alignas(64) static const uint16_t kInterleave[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i idx_lo = _mm512_load_si512(kInterleave[0]), idx_hi = _mm512_load_si512(kInterleave[1]);
  for (int64_t j = 0; j < 8; ++j) {
    const int64_t ta = 2 * j, tb = ta + 1;
    for (int64_t c = 0; c < DIM / 32; ++c) {  // 32 elements of each row: two 16-lane output chunks
      const __m512i a = ta >= lo && ta < hi ? _mm512_loadu_si512(values + ta * s_token + 32 * c) : _mm512_setzero_si512();
      const __m512i b = tb >= lo && tb < hi ? _mm512_loadu_si512(values + tb * s_token + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vp[j] + 32 * c, _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_store_si512(vp[j] + 32 * c + 16, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

// A packed tile of 16 values (as pack_values lays them out) with the values outside [lo, hi) zeroed.
template <int64_t DIM>
inline void zero_outside(const int32_t (*src)[8][DIM], int64_t lo, int64_t hi, int32_t (*dst)[DIM]) {
  for (int64_t j = 0; j < 8; ++j) {
    const uint32_t keep = (2 * j >= lo && 2 * j < hi ? 0x0000FFFFu : 0u) | (2 * j + 1 >= lo && 2 * j + 1 < hi ? 0xFFFF0000u : 0u);
    const __m512i m = _mm512_set1_epi32(static_cast<int32_t>(keep));
    for (int64_t c = 0; c < DIM; c += 16) {
      _mm512_store_si512(dst[j] + c, _mm512_and_si512(_mm512_loadu_si512((*src)[j] + c), m));
    }
  }
}

// Asks for the 16 keys and values from offset `at` on (every 64-byte line of them) to be brought into cache:
// into L1 (LOCALITY 3, prefetcht0), or into L2 only (1, prefetcht2; see KeyStream).
template <int64_t DIM, int LOCALITY = 3>
inline void prefetch_tile(const Bf16* k, const Bf16* v, int64_t at, int64_t s_token) {
  for (int64_t t = 0; t < 16; ++t) {
    for (int64_t off = 0; off < DIM; off += 32) {
      __builtin_prefetch(k + at + t * s_token + off, 0, LOCALITY);
      __builtin_prefetch(v + at + t * s_token + off, 0, LOCALITY);
    }
  }
}

// The decode rows' own keys (each sequence's few scattered blocks past the shared ones: no hardware
// prefetcher can predict them, and with 3 rows to a tile reading them is bound by memory latency) as one
// stream over a task's sequences, asked for kAhead tiles before they are read, one tile per tile read.
// Spread out this way the requests keep the memory busy; asking for a whole sequence's keys at once (as
// before) overflowed the miss buffers, and a 64-row decode step's attention took ~15% longer. They are asked
// into L2, 16 tiles ahead. A prefetch into L1 holds one of L1's few miss buffers until its line arrives,
// and 8 tiles are 512 lines, so most of them waited in line. Into L2, with twice as many tiles in flight,
// the own keys read ~10-20% faster on a Zen 4 (decode micro-benchmark: 192-320 own keys a sequence, 30
// layers), and a tile read from L2 costs its 3 rows little beside their dot products.
template <int64_t DIM>
struct KeyStream {
  static constexpr int64_t kAhead = 16;  // tiles
  const Paged& pg;
  const Bf16* k;
  const Bf16* v;
  const int64_t* tables;
  const int64_t* lens;
  int64_t width, end, shared;
  int64_t b, pos;  // the next tile to ask for: sequence b's keys from position pos

  KeyStream(const Paged& pg_, int64_t h, const int64_t* tables_, int64_t width_, const int64_t* lens_, int64_t first,
            int64_t count, int64_t shared_)
      : pg(pg_), k(pg_.k + h * pg_.s_head), v(pg_.v + h * pg_.s_head), tables(tables_), lens(lens_), width(width_),
        end(first + count), shared(shared_), b(first), pos(shared_) {}

  // Not inlined: called from inside attend's tile loop, where its loop would crowd the registers.
  __attribute__((noinline)) void ask(int64_t tiles) {
    for (; tiles > 0 && b < end; --tiles) {  // (b == end: every own key has been asked for)
      while (pos >= lens[b]) {
        if (++b >= end) return;
        pos = shared;
      }
      prefetch_tile<DIM, 1>(k, v, tables[b * width + pos / pg.block_size] * pg.s_block + (pos % pg.block_size) * pg.s_token,
                            pg.s_token);
      pos += 16 - pos % 16;
    }
  }
};

// Up to kMaxRows query rows attending together, with their online-softmax state: each row has its
// query, the last position it sees (its own) and the first (a window's start, else 0). `attend` runs a
// range of rows over a range of one block table's keys, so rows can read keys they share together
// (a prompt tile's rows, or the decode rows of sequences sharing a prefix) and the rest apart.
template <int64_t DIM>
struct Rows {
  static constexpr int64_t kPairs = DIM / 2;  // int32 pairs of bf16 along head_dim
  static constexpr int64_t kChunks = DIM / 16;
  using KTile = int32_t[kPairs][16];  // 16 keys: [p][t] = key t's elements 2p, 2p + 1
  using VTile = int32_t[8][DIM];      // 16 values: [j][d] = element d of values 2j (low half), 2j + 1 (high)
  int64_t n = 0;
  const int32_t* q[kMaxRows];
  int32_t pos[kMaxRows];
  int32_t low[kMaxRows];
  alignas(64) float acc[kMaxRows][DIM];
  float m[kMaxRows];  // per row, the running maximum of its scores, in base-2 units (times log2(e))
  alignas(64) float lv[kMaxRows][16];  // per row, the softmax denominators' partial sums by lane

  void add(const Bf16* query, int64_t position, int64_t first_visible) {
    q[n] = reinterpret_cast<const int32_t*>(query);
    pos[n] = static_cast<int32_t>(position);
    low[n] = static_cast<int32_t>(first_visible);
    for (int64_t d = 0; d < DIM; ++d) acc[n][d] = 0.0f;
    m[n] = -1e30f;
    for (int64_t i = 0; i < 16; ++i) lv[n][i] = 0.0f;
    ++n;
  }

  // sc[i][u0 + u] = the scores of rows q[0..N) against the 16 packed keys *kp[u], u < NT. Each query pair
  // loaded (broadcast) serves NT tiles, and the N x NT accumulators are independent, enough to cover the
  // dot product's latency. A score is the same sum in the same order whatever N and NT are.
  template <int64_t N, int64_t NT>
  static inline void scores(const int32_t* const* qr, const KTile* const* kp, __m512 (*sc)[kMaxTiles], int64_t u0) {
    __m512 acc_[N][NT];
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t u = 0; u < NT; ++u) acc_[i][u] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh kv[NT];
      for (int64_t u = 0; u < NT; ++u) kv[u] = (__m512bh)_mm512_load_si512((*kp[u])[p]);
      for (int64_t i = 0; i < N; ++i) {
        const __m512bh qi = (__m512bh)_mm512_set1_epi32(qr[i][p]);
        for (int64_t u = 0; u < NT; ++u) acc_[i][u] = _mm512_dpbf16_ps(acc_[i][u], qi, kv[u]);
      }
    }
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t u = 0; u < NT; ++u) sc[i][u0 + u] = acc_[i][u];
    }
  }

  // Tiles read per pass for a call over n rows: 16-24 accumulators in flight whatever n is (a decode
  // sequence's own keys have only its 3 heads' rows).
  static constexpr int64_t tiles_for(int64_t n) { return n <= 3 ? 8 : n <= 6 ? 4 : 2; }

  template <int64_t N>
  static inline void scores_n(const int32_t* const* qr, const KTile* const* kp, int64_t nt, __m512 (*sc)[kMaxTiles]) {
    constexpr int64_t NT = tiles_for(N);
    if (nt == NT) {
      scores<N, NT>(qr, kp, sc, 0);
    } else {
      for (int64_t u = 0; u < nt; ++u) scores<N, 1>(qr, kp + u, sc, u);  // a pass's last, partial group
    }
  }

  // The scores of the first n <= kRowBlock rows of qr against nt tiles.
  static inline void scores_dispatch(int64_t n, const int32_t* const* qr, const KTile* const* kp, int64_t nt,
                                     __m512 (*sc)[kMaxTiles]) {
    static_assert(kRowBlock == 8, "a case for each row count below kRowBlock");
    switch (n) {
      case 1: scores_n<1>(qr, kp, nt, sc); break;
      case 2: scores_n<2>(qr, kp, nt, sc); break;
      case 3: scores_n<3>(qr, kp, nt, sc); break;
      case 4: scores_n<4>(qr, kp, nt, sc); break;
      case 5: scores_n<5>(qr, kp, nt, sc); break;
      case 6: scores_n<6>(qr, kp, nt, sc); break;
      case 7: scores_n<7>(qr, kp, nt, sc); break;
      default: scores_n<kRowBlock>(qr, kp, nt, sc); break;
    }
  }

  // Rows [r, r + N) add their probabilities' products with the tile's values: acc[row] += sum over key
  // pairs j, in order, of pb[row][j] (two bf16 probabilities) times vp[j]. The value chunks loaded serve
  // all N rows; each row's sum is the same chain of operations whichever rows share the call.
  template <int64_t N>
  inline void add_values(int64_t r, const int32_t (*pb)[8], const VTile& vp) {
    __m512 o[N][kChunks];
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t c = 0; c < kChunks; ++c) o[i][c] = _mm512_load_ps(acc[r + i] + 16 * c);
    }
    for (int64_t j = 0; j < 8; ++j) {
      __m512bh vj[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) vj[c] = (__m512bh)_mm512_load_si512(vp[j] + 16 * c);
      for (int64_t i = 0; i < N; ++i) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(pb[i][j]);
        for (int64_t c = 0; c < kChunks; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], pj, vj[c]);
      }
    }
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t c = 0; c < kChunks; ++c) _mm512_store_ps(acc[r + i] + 16 * c, o[i][c]);
    }
  }

  // Rows [row_begin, row_end) over keys [key_lo, key_hi) of `table`, in kv head h's pages.
  // With a stream, the keys asked for come from it (a decode sequence's own keys); else from the table (ask_tile).
  void attend(int64_t row_begin, int64_t row_end, const Paged& pg, int64_t h, const int64_t* table, int64_t key_lo,
              int64_t key_hi, KeyStream<DIM>* stream = nullptr) {
    // Rows sharing one load of a value chunk in add_values: as many as keep their sums in registers
    // (a row's sums take DIM / 16 of the 32 vector registers).
    constexpr int64_t kPvRows = DIM == 64 ? 4 : DIM == 128 ? 2 : 1;
    const Bf16* k = pg.k + h * pg.s_head;
    const Bf16* v = pg.v + h * pg.s_head;
    const int64_t block_size = pg.block_size, s_block = pg.s_block, s_token = pg.s_token;
    alignas(64) KTile kbuf[kMaxTiles];  // tiles packed here (from a standard cache, or a packed tile's edge)
    alignas(64) VTile vbuf[kMaxTiles];
    const KTile* kp[kMaxTiles];         // the pass's tiles' keys and values as the products read them
    const VTile* vp[kMaxTiles];
    const int64_t per_pass = tiles_for(std::min<int64_t>(row_end - row_begin, kRowBlock));
    alignas(64) int32_t pb[kRowBlock][8];   // a row block's probabilities for one tile, as bf16 pairs
    bool seen[kRowBlock];                   // whether the row sees any key of that tile
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 vscale = _mm512_set1_ps(pg.scale * kLog2e);  // scores in base-2 units (see exp2_nonpositive)
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    // Blocks are scattered, so the hardware prefetcher cannot see the next tiles coming: tiles are asked
    // for kAheadTiles beyond the next pass while these compute (few rows per tile, as in decoding, leave
    // little else to hide it), one tile per tile read. Spread out this way, the requests keep the memory
    // busy without overflowing the miss buffers: asking for a pass's tiles in one burst, each pass for the
    // whole next pass and 4 beyond (as before, most of them already on their way), left a 64-row grouped
    // decode step's attention ~13% slower; 4 or 12 tiles ahead measure ~3% slower than 8, 16 ~10%.
    const auto ask_tile = [&](int64_t t) {
      prefetch_tile<DIM>(k, v, table[t / block_size] * s_block + (t % block_size) * s_token, s_token);
    };

    // Tiles of 16 keys at fixed positions (multiples of 16), two at a time; a row's softmax still moves
    // tile by tile, so its result depends on the keys alone, not on which rows or tiles shared a call.
    for (int64_t t0 = key_lo - key_lo % 16; t0 < key_hi; t0 += 16 * per_pass) {
      const int64_t nt = std::min<int64_t>(per_pass, (key_hi - t0 + 15) / 16);
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t tu = t0 + 16 * u;
        const int64_t block = table[tu / block_size];
        const int64_t off = tu % block_size;
        // Keys of this tile that any row may see; the others (before the window, past the context) are
        // zeroed so that garbage in unused slots (even NaN) cannot reach a sum.
        const int64_t lo = std::max<int64_t>(key_lo - tu, 0), hi = std::min<int64_t>(key_hi - tu, 16);
        const Bf16* kb = k + block * s_block + off * s_token;
        const Bf16* vb = v + block * s_block + off * s_token;
        if (pg.packed) {
          // Read in place. Scores of keys outside [lo, hi) are masked off whatever they hold; values there
          // get probability 0, and 0 times garbage (a NaN in a never-written slot) must not reach a sum.
          kp[u] = reinterpret_cast<const KTile*>(kb);
          if (lo == 0 && hi == 16) {
            vp[u] = reinterpret_cast<const VTile*>(vb);
          } else {
            zero_outside<DIM>(reinterpret_cast<const VTile*>(vb), lo, hi, vbuf[u]);
            vp[u] = &vbuf[u];
          }
        } else {
          pack_keys<DIM>(kb, s_token, lo, hi, kbuf[u]);
          pack_values<DIM>(vb, s_token, lo, hi, vbuf[u]);
          kp[u] = &kbuf[u];
          vp[u] = &vbuf[u];
        }
      }
      if (!stream && t0 == key_lo - key_lo % 16) {
        // The first pass asks for the kAheadTiles tiles after it; each tile read then asks for the one
        // kAheadTiles beyond the next pass (below).
        for (int64_t nt0 = t0 + 16 * per_pass; nt0 < std::min(t0 + 16 * (per_pass + kAheadTiles), key_hi); nt0 += 16) {
          ask_tile(nt0);
        }
      }

      for (int64_t r0 = row_begin; r0 < row_end; r0 += kRowBlock) {
        __m512 sc[kRowBlock][kMaxTiles];
        const int64_t live_rows = std::min<int64_t>(kRowBlock, row_end - r0);
        if (live_rows == kRowBlock) {
          scores_n<kRowBlock>(q + r0, kp, nt, sc);
        } else {
          scores_dispatch(live_rows, q + r0, kp, nt, sc);
        }
        for (int64_t u = 0; u < nt; ++u) {
          if (r0 == row_begin) {
            if (stream) {
              stream->ask(1);
            } else if (t0 + 16 * (per_pass + kAheadTiles + u) < key_hi) {
              ask_tile(t0 + 16 * (per_pass + kAheadTiles + u));
            }
          }
          const __m512i kpos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(t0 + 16 * u)), lane);
          bool all_seen = true;
          for (int64_t i = 0; i < live_rows; ++i) {
            const int64_t r = r0 + i;
            const __mmask16 vis = _mm512_cmple_epi32_mask(kpos, _mm512_set1_epi32(pos[r])) &
                                  _mm512_cmpge_epi32_mask(kpos, _mm512_set1_epi32(low[r]));
            seen[i] = vis != 0;
            if (!vis) {
              all_seen = false;
              continue;
            }
            const __m512 x = _mm512_mask_blend_ps(vis, neg_inf, _mm512_mul_ps(sc[i][u], vscale));
            // The running maximum moves only if some lane passes it: test that with one compare, and pay
            // for the horizontal maximum and the rescaling only then (after a row's first tiles, rarely).
            if (_mm512_cmp_ps_mask(x, _mm512_set1_ps(m[r]), _CMP_GT_OQ)) {
              const float m_tile = _mm512_reduce_max_ps(x);
              const __m512 va = _mm512_set1_ps(exp2_nonpositive(m[r] - m_tile));
              for (int64_t c = 0; c < kChunks; ++c) {
                _mm512_store_ps(acc[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), va));
              }
              _mm512_store_ps(lv[r], _mm512_mul_ps(_mm512_load_ps(lv[r]), va));
              m[r] = m_tile;
            }
            const __m512 pr = _mm512_maskz_mov_ps(vis, exp2_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(m[r]))));
            _mm512_store_ps(lv[r], _mm512_add_ps(_mm512_load_ps(lv[r]), pr));
            _mm256_store_si256(reinterpret_cast<__m256i*>(pb[i]), (__m256i)_mm512_cvtneps_pbh(pr));
          }
          int64_t i = 0;
          if (all_seen) {
            for (; i + kPvRows <= live_rows; i += kPvRows) add_values<kPvRows>(r0 + i, pb + i, *vp[u]);
            // The rest together too (a decode sequence's own keys: its 3 heads' rows).
            if (kPvRows >= 3 && live_rows - i == 3) add_values<3>(r0 + i, pb + i, *vp[u]), i += 3;
            if (kPvRows >= 2 && live_rows - i == 2) add_values<2>(r0 + i, pb + i, *vp[u]), i += 2;
          }
          for (; i < live_rows; ++i) {
            if (seen[i]) add_values<1>(r0 + i, pb + i, *vp[u]);
          }
        }
      }
    }
  }

  void write(int64_t r, Bf16* out) const {
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(lv[r]));  // every query sees at least itself
    for (int64_t d = 0; d < DIM; ++d) out[d] = static_cast<Bf16>(acc[r][d] * inv);
  }
};

// One prompt task: a tile of one sequence's queries, for one kv head.
template <int64_t DIM>
void prefill_task(const Paged& pg, const Seq& s, const Task& task, int64_t window) {
  const int64_t pos0 = s.ctx - s.q_len + task.first;  // position of the tile's first query
  Rows<DIM> rows;
  for (int64_t qi = 0; qi < task.count; ++qi) {
    for (int64_t g = 0; g < pg.group; ++g) {
      const int64_t p = pos0 + qi;
      rows.add(pg.q + pg.at(s.q_start + task.first + qi, task.head, g, DIM), p,
               window > 0 ? std::max<int64_t>(0, p - window + 1) : 0);
    }
  }
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  rows.attend(0, rows.n, pg, task.head, s.table, key_lo, pos0 + task.count);
  for (int64_t r = 0; r < rows.n; ++r) {
    rows.write(r, pg.out + pg.at(s.q_start + task.first + r / pg.group, task.head, r % pg.group, DIM));
  }
}

// One decode task: `task.count` single-query sequences from `task.first` on, sharing their first
// `shared` keys (the same blocks), for one kv head. The shared keys are read once for all their rows.
template <int64_t DIM>
void decode_group_task(const Paged& pg, const int64_t* tables, int64_t width, const int64_t* lens, const int64_t* row_of,
                       const Task& task, int64_t shared) {
  Rows<DIM> rows;
  const int64_t first = task.first, group = pg.group;
  for (int64_t b = first; b < first + task.count; ++b) {
    for (int64_t g = 0; g < group; ++g) rows.add(pg.q + pg.at(row_of[b], task.head, g, DIM), lens[b] - 1, 0);
  }
  // The first own keys are asked for now, to arrive while the shared keys compute.
  KeyStream<DIM> own(pg, task.head, tables, width, lens, first, task.count, shared);
  own.ask(KeyStream<DIM>::kAhead);
  rows.attend(0, rows.n, pg, task.head, tables + first * width, 0, shared);
  for (int64_t i = 0; i < task.count; ++i) {
    const int64_t b = first + i;
    rows.attend(i * group, (i + 1) * group, pg, task.head, tables + b * width, shared, lens[b], &own);
    for (int64_t g = 0; g < group; ++g) rows.write(i * group + g, pg.out + pg.at(row_of[b], task.head, g, DIM));
  }
}

#endif

bool prefill_supported(int64_t dim, int64_t block_size) {
#ifdef KVPOOL_AVX512_BF16
  return (dim == 64 || dim == 128 || dim == 256) && block_size % 16 == 0;
#else
  (void)dim;
  (void)block_size;
  return false;
#endif
}

// Runs fn(task) for every task over torch's threads, longest first and handed out one at a time:
// causal tiles and groups of different sizes differ widely in cost.
template <typename Fn>
void run_tasks(std::vector<Task>& tasks, const Fn& fn) {
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const auto n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < n; ++i) fn(tasks[i]);
}

// The checks every op here makes of q, out and the caches, q in `dtype` (bf16; fp32 for grouped decode rows)
// and the caches in `dtype` too, or in bf16, fp16 or fp8 under fp32 queries (a narrower KV cache of an fp32 model).
void check_paged_layout(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, at::ScalarType dtype, int64_t max_group, bool packed) {
  const at::ScalarType kc = k_cache.scalar_type();
  const at::ScalarType kv = dtype == at::kFloat && narrow_kv(kc) ? kc : dtype;
  KV_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == dtype, "q must be a contiguous ", dtype,
              " (rows, heads, head_dim) tensor");
  KV_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous and shaped and typed like q");
  KV_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == kv && v_cache.scalar_type() == kv,
              "k_cache and v_cache must share one ", dtype, " (or, under float32 queries, bfloat16, float16 or fp8) "
              "(kv_heads, blocks, block_size, head_dim) layout");
  KV_CHECK(k_cache.stride(3) == 1, "head_dim must be the caches' innermost, contiguous dimension");
  KV_CHECK(k_cache.size(3) == q.size(2), "q and the caches disagree on head_dim");
  KV_CHECK(q.size(1) >= 1 && k_cache.size(0) >= 1 && q.size(1) % k_cache.size(0) == 0 &&
               q.size(1) / k_cache.size(0) <= max_group,
              "heads / kv_heads must be a whole number <= ", max_group);
  KV_CHECK(!packed || (k_cache.stride(2) == k_cache.size(3) && k_cache.stride(1) == k_cache.size(2) * k_cache.size(3)),
              "packed caches must have each block's tokens contiguous");
}

void check_paged_bf16(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      bool packed) {
  check_paged_layout(q, out, k_cache, v_cache, at::kBFloat16, kMaxRows, packed);
  KV_CHECK(prefill_supported(q.size(2), k_cache.size(2)),
              "needs AVX-512 BF16, head_dim 64, 128 or 256 and block_size a multiple of 16");
}

// The fp32 ops' limits: the grouped decode runs on any CPU (prefill_f32.cpp's kernel where it runs, else
// decode_attention.cpp's loops); prompts and the packed layout need prefill_f32.cpp's kernel.
void check_paged_f32(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     bool packed) {
  check_paged_layout(q, out, k_cache, v_cache, at::kFloat, 16, packed);
  KV_CHECK(q.size(2) <= 256 && k_cache.size(2) <= 256, "head_dim <= 256 and block_size <= 256 only");
  KV_CHECK(!packed || prefill_f32_supported(q.size(2), k_cache.size(2)),
              "packed: float32 caches in the packed layout need AVX2 and FMA, head_dim 64, 128 or 256 and block_size "
              "a multiple of 8");
  KV_CHECK(k_cache.scalar_type() == at::kFloat || prefill_f32_supported(q.size(2), k_cache.size(2)),
              "16-bit and fp8 caches under float32 queries need AVX2 and FMA, head_dim 64, 128 or 256 and block_size a "
              "multiple of 8");
}

// What the fp32 kernels (prefill_f32.cpp) read and write, after check_paged_f32.
PagedF32 paged_f32(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   double scale, bool packed) {
  return {q.const_data_ptr<float>(), out.mutable_data_ptr<float>(), k_cache.const_data_ptr(),
          v_cache.const_data_ptr(), q.size(1), q.size(1) / k_cache.size(0), q.size(2), k_cache.stride(0),
          k_cache.stride(1), k_cache.stride(2), k_cache.size(2), static_cast<float>(scale), packed,
          kv_elem_of(k_cache.scalar_type())};
}

// q: (T, heads, D) bf16 (or fp32 where prefill_f32_supported: prefill_f32.cpp); k_cache, v_cache:
// (kv_heads, blocks, block_size, D); per sequence: its first row in q, its number of queries, its context length (queries included) and its block table (a row of
// `tables`, (S, W) int64). window > 0: each query sees that many most recent positions, itself included.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& ctx_lens,
                                   const at::Tensor& tables, int64_t window, double scale, at::Tensor out,
                                   bool packed) {
  const bool f32 = q.scalar_type() == at::kFloat;
  KV_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  if (f32) {
    check_paged_f32(q, out, k_cache, v_cache, packed);
    KV_CHECK(prefill_f32_supported(q.size(2), k_cache.size(2)),
                "float32 prompts need AVX2 and FMA, head_dim 64, 128 or 256 and block_size a multiple of 8");
  } else {
    check_paged_bf16(q, out, k_cache, v_cache, packed);
  }
  const int64_t n_tok = q.size(0), heads = q.size(1);
  [[maybe_unused]] const int64_t dim = q.size(2);  // used by the AVX-512 build only
  const int64_t kv_heads = k_cache.size(0), blocks = k_cache.size(1), block_size = k_cache.size(2);
  for (const auto* t : {&q_starts, &q_lens, &ctx_lens}) {
    KV_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == tables.size(0),
                "q_starts, q_lens and ctx_lens must be contiguous int64 (S,) tensors, one entry per table row");
  }
  KV_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "tables must be a contiguous int64 (S, W) tensor");
  const int64_t n_seq = tables.size(0), width = tables.size(1), group = heads / kv_heads;
  const int64_t* qs = q_starts.const_data_ptr<int64_t>();
  const int64_t* ql = q_lens.const_data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.const_data_ptr<int64_t>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  std::vector<Seq> seqs;
  std::vector<Task> tasks;
  const int64_t tile = std::max<int64_t>(1, (f32 ? kPrefillF32Rows : kMaxRows) / group);
  for (int64_t i = 0; i < n_seq; ++i) {
    // (written so that no sum can overflow: a start near 2^63 must fail the check, not wrap past it)
    KV_CHECK(ql[i] >= 1 && ql[i] <= n_tok && qs[i] >= 0 && qs[i] <= n_tok - ql[i], "sequence ", i, ": ", ql[i],
                " rows from row ", qs[i], " are not in q's ", n_tok, " rows");
    KV_CHECK(ql[i] <= cl[i] && cl[i] <= width * block_size, "sequence ", i, ": ", ql[i], " queries and ", cl[i],
                " keys do not fit its ", width, " blocks");
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, cl[i] - ql[i] - window + 1) : 0;
    for (int64_t j = first_key / block_size; j <= (cl[i] - 1) / block_size; ++j) {
      KV_CHECK(0 <= tp[i * width + j] && tp[i * width + j] < blocks, "sequence ", i, ": block id ",
                  tp[i * width + j], " is outside the cache's ", blocks, " blocks");
    }
    seqs.push_back({qs[i], ql[i], cl[i], tp + i * width});
    for (int64_t f = 0; f < ql[i]; f += tile) {
      const int64_t n = std::min(tile, ql[i] - f);
      const int64_t end = cl[i] - ql[i] + f + n;
      const int64_t keys = window > 0 ? std::min(end, window + n) : end;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({i, h, f, n, keys * n});
    }
  }
  if (f32) {
    const PagedF32 pg = paged_f32(q, out, k_cache, v_cache, scale, packed);
    run_tasks(tasks, [&](const Task& t) {
      const Seq& s = seqs[t.seq];
      prefill_f32_task(pg, s.table, s.q_start, s.q_len, s.ctx, t.head, t.first, t.count, window);
    });
    return out;
  }
#ifdef KVPOOL_AVX512_BF16
  const Paged pg(q, out, k_cache, v_cache, scale, packed);
  auto* fn = dim == 64 ? &prefill_task<64> : dim == 128 ? &prefill_task<128> : &prefill_task<256>;
  run_tasks(tasks, [&](const Task& t) { fn(pg, seqs[t.seq], t, window); });
#endif
  return out;
}

// Decode rows in groups that share leading blocks: q (T, heads, D) bf16 (or fp32, on any CPU), whose row rows[b] is the query
// of sequence b (b < B), with table row b of `tables` (B, W) and lens[b] keys (its query the last); its
// output goes to the same row of out (other rows are left alone: a step's prompt chunks write them). The
// sequences of group i are [group_starts[i], group_starts[i + 1]), and their first shared[i] keys lie in
// the same blocks.
at::Tensor paged_decode_grouped(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& lens,
                                const at::Tensor& group_starts, const at::Tensor& shared, double scale, at::Tensor out,
                                bool packed) {
  const bool f32 = q.scalar_type() == at::kFloat;
  if (f32) {
    check_paged_f32(q, out, k_cache, v_cache, packed);
  } else {
    check_paged_bf16(q, out, k_cache, v_cache, packed);
  }
  KV_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be a contiguous int64 (B,) tensor");
  const int64_t batch = rows.size(0), heads = q.size(1);
  [[maybe_unused]] const int64_t dim = q.size(2);  // used by the AVX-512 build only
  const int64_t kv_heads = k_cache.size(0), blocks = k_cache.size(1), block_size = k_cache.size(2);
  KV_CHECK(tables.dim() == 2 && tables.size(0) == batch && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous(), "tables must be a contiguous int64 (B, W) tensor");
  KV_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == batch,
              "lens must be a contiguous int64 (B,) tensor");
  KV_CHECK(group_starts.scalar_type() == at::kLong && shared.scalar_type() == at::kLong &&
                  group_starts.is_contiguous() && shared.is_contiguous() && group_starts.numel() == shared.numel() + 1,
              "group_starts (G + 1,) and shared (G,) must be contiguous int64 tensors");
  const int64_t width = tables.size(1), group = heads / kv_heads, n_groups = shared.numel();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* ln = lens.const_data_ptr<int64_t>();
  const int64_t* gs = group_starts.const_data_ptr<int64_t>();
  const int64_t* sh = shared.const_data_ptr<int64_t>();
  const int64_t* ro = rows.const_data_ptr<int64_t>();
  KV_CHECK(gs[0] == 0 && gs[n_groups] == batch, "group_starts must run from 0 to B");
  for (int64_t i = 0; i < n_groups; ++i) {  // (before any is used as an index)
    KV_CHECK(gs[i] < gs[i + 1], "group_starts must increase: group ", i, " is empty");
  }
  for (int64_t b = 0; b < batch; ++b) {
    KV_CHECK(0 <= ro[b] && ro[b] < q.size(0), "sequence ", b, ": row ", ro[b], " is not in q's ", q.size(0), " rows");
    KV_CHECK(1 <= ln[b] && ln[b] <= width * block_size, "sequence ", b, ": ", ln[b], " keys do not fit its ", width,
                " blocks");
    for (int64_t j = 0; j <= (ln[b] - 1) / block_size; ++j) {
      KV_CHECK(0 <= tp[b * width + j] && tp[b * width + j] < blocks, "sequence ", b, ": block id ",
                  tp[b * width + j], " is outside the cache's ", blocks, " blocks");
    }
  }
  std::vector<Task> tasks;  // (first sequence, kv head, count): seq holds the group
  const int64_t per_task = std::max<int64_t>(1, kMaxRows / group);
  for (int64_t i = 0; i < n_groups; ++i) {
    KV_CHECK(gs[i] < gs[i + 1], "group ", i, " is empty");
    KV_CHECK(sh[i] >= 0 && sh[i] % block_size == 0, "group ", i, ": shared keys must be whole blocks");
    for (int64_t b = gs[i]; b < gs[i + 1]; ++b) {
      KV_CHECK(sh[i] <= ln[b], "group ", i, ": ", sh[i], " shared keys, but sequence ", b, " has ", ln[b]);
      for (int64_t j = 0; j < sh[i] / block_size; ++j) {
        KV_CHECK(tp[b * width + j] == tp[gs[i] * width + j], "group ", i, ": sequence ", b,
                    " does not share block ", j, " with the group's first sequence");
      }
    }
    for (int64_t f = gs[i]; f < gs[i + 1]; f += per_task) {
      const int64_t n = std::min(per_task, gs[i + 1] - f);
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({i, h, f, n, n * ln[f]});
    }
  }
  if (f32 && prefill_f32_supported(q.size(2), block_size)) {
    // On the prompt kernel (prefill_f32.cpp): a decode row's arithmetic is then a prompt row's.
    const PagedF32 pg = paged_f32(q, out, k_cache, v_cache, scale, packed);
    run_tasks(tasks, [&](const Task& t) { decode_group_f32_rows(pg, tp, width, ln, ro, t.head, t.first, t.count, sh[t.seq]); });
    return out;
  }
  if (f32) {  // other shapes and CPUs: decode_attention.cpp's loops
    const float* qp = q.const_data_ptr<float>();
    float* op = out.mutable_data_ptr<float>();
    const float* kp = k_cache.const_data_ptr<float>();
    const float* vp = v_cache.const_data_ptr<float>();
    run_tasks(tasks, [&](const Task& t) {
      decode_group_f32(qp, op, kp, vp, heads, q.size(2), t.head, k_cache.stride(0), k_cache.stride(1),
                       k_cache.stride(2), block_size, tp, width, ln, ro, t.first, t.count, sh[t.seq], group,
                       static_cast<float>(scale));
    });
    return out;
  }
#ifdef KVPOOL_AVX512_BF16
  const Paged pg(q, out, k_cache, v_cache, scale, packed);
  auto* fn = dim == 64 ? &decode_group_task<64> : dim == 128 ? &decode_group_task<128> : &decode_group_task<256>;
  run_tasks(tasks, [&](const Task& t) { fn(pg, tp, width, ln, ro, t, sh[t.seq]); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool, m) {
  m.def("paged_decode_grouped(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor tables, Tensor lens, "
        "Tensor group_starts, Tensor shared, float scale, Tensor(a!) out, bool packed=False) -> Tensor(a!)");
  m.impl("paged_decode_grouped", c10::DispatchKey::CPU, &paged_decode_grouped);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_starts, Tensor q_lens, "
        "Tensor ctx_lens, Tensor tables, int window, float scale, Tensor(a!) out, bool packed=False) -> Tensor(a!)");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  m.def("prefill_supported(int head_dim, int block_size, bool f32=False) -> bool", [](int64_t d, int64_t b, bool f32) {
    return f32 ? prefill_f32_supported(d, b) : prefill_supported(d, b);
  });
}
