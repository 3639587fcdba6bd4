// The bf16 linear layers of a bf16 model (y = x W^T + b) on AVX-512 BF16's dot-product instruction, chosen
// where oneDNN's is not row-count invariant, or everywhere with KVPOOL_BF16_LINEAR=kvpool (see
// kvpool.runner.models.llama.PackedLinear).
//
// Why have it: at a decode step's row counts (tens of rows) oneDNN splits SmolLM2's narrow projections (576
// and 960 outputs) unevenly over two threads: 64 rows ran its q/k/v and attention-output projections at
// ~290 GFLOP/s against ~340-370 here, while per core both run at ~85-95% of the instruction's peak. At
// thousands of rows (prompts) oneDNN is 0-5% faster. (docs/benchmarks.md, session 24.) A row's result is
// computed the same way whatever the row count and wherever the row lands in a tile (each output is one
// fp32 sum over k in order, rounded once to bf16), so batch invariance holds by construction.
//
// Layout: the weight is packed once, at load, as [N/16 column groups][K/2 pairs][16 columns][2]: one
// 64-byte line holds 16 columns' pair of k values, which is what `vdpbf16ps` multiplies against one
// broadcast pair of an input row. N is padded to 16 and K to even with zeros.
// Blocking: 8 rows x 48 columns of fp32 accumulators (24 of the 32 vector registers) over the whole of
// K; 48-column panels are split over the threads; rows go in blocks whose slice of x (~128 KB) stays in
// L2 while every panel passes over it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

#ifdef KVPOOL_AVX512_BF16
#include <immintrin.h>
#endif

namespace {

using kvpool_kernels::message;

constexpr int64_t kGroup = 16;      // columns per packed group (one vector of fp32 lanes)
constexpr int kPanelGroups = 3;     // groups per register panel: 48 columns
constexpr int kTileRows = 8;        // rows per register tile
constexpr int64_t kRowBlockBytes = 128 * 1024;

// w: (N, K) bf16 -> (ceil(N / 16), ceil(K / 2), 16, 2) bf16.
at::Tensor pack_linear_bf16(const at::Tensor& w) {
  KV_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) > 0 && w.size(1) > 0,
           "weight must be a non-empty (out_features, in_features) bfloat16 tensor");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t groups = (n + kGroup - 1) / kGroup, pairs = (k + 1) / 2;
  at::Tensor out = at::zeros({groups, pairs, kGroup, 2}, w.options());
  const at::Tensor src = w.contiguous();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.const_data_ptr());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t c = 0; c < kGroup && g * kGroup + c < n; ++c) {
        const uint16_t* row = s + (g * kGroup + c) * k;
        for (int64_t i = 0; i < k; ++i) d[((g * pairs + i / 2) * kGroup + c) * 2 + i % 2] = row[i];
      }
  });
  return out;
}

#ifdef KVPOOL_AVX512_BF16

// One register tile: ROWS rows x GROUPS * 16 columns over all of K, then rounded to bf16 and stored
// (the first `cols` columns; the rest of a padded group is not written). `prefetch`: a whole panel of
// weights to ask into L2 meanwhile, line by line as this tile reads its own, or null.
template <int ROWS, int GROUPS>
void tile(const uint16_t* x, int64_t k, const uint16_t* w, int64_t pairs, const float* bias, uint16_t* y,
          int64_t ldy, int cols, const uint16_t* prefetch) {
  __m512 acc[ROWS][GROUPS];
  for (int g = 0; g < GROUPS; ++g) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + g * kGroup) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) acc[r][g] = b;
  }
  const int64_t group_stride = pairs * kGroup * 2;
  const int64_t whole = k / 2;  // pairs read with one 4-byte load; an odd K's last pair is padded
  for (int64_t p = 0; p < whole; ++p) {
    if (prefetch != nullptr) {
      for (int g = 0; g < kPanelGroups; ++g)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + g * group_stride + p * kGroup * 2), _MM_HINT_T1);
    }
    __m512bh b[GROUPS];
    for (int g = 0; g < GROUPS; ++g)
      b[g] = (__m512bh)_mm512_loadu_si512(w + g * group_stride + p * kGroup * 2);
    for (int r = 0; r < ROWS; ++r) {
      int32_t v;
      std::memcpy(&v, x + r * k + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(v);
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, b[g]);
    }
  }
  if (whole < pairs) {
    __m512bh b[GROUPS];
    for (int g = 0; g < GROUPS; ++g)
      b[g] = (__m512bh)_mm512_loadu_si512(w + g * group_stride + whole * kGroup * 2);
    for (int r = 0; r < ROWS; ++r) {
      // An odd K's last pair is (x[K-1], 0): read as one element, so that no load passes the row's end.
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * k + k - 1]));
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, b[g]);
    }
  }
  for (int g = 0; g < GROUPS; ++g) {
    const int c = cols - g * static_cast<int>(kGroup);
    if (c <= 0) break;
    const __mmask16 m = c >= kGroup ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
    for (int r = 0; r < ROWS; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + g * kGroup, m, (__m256i)_mm512_cvtneps_pbh(acc[r][g]));
  }
}

template <int GROUPS>
void panel_rows(int64_t rows, const uint16_t* x, int64_t k, const uint16_t* w, int64_t pairs, const float* bias,
                uint16_t* y, int64_t ldy, int cols, const uint16_t* prefetch) {
  int64_t r = 0;
  // The second whole tile asks for the next panel (the first one reads this panel from memory itself).
  for (; r + kTileRows <= rows; r += kTileRows)
    tile<kTileRows, GROUPS>(x + r * k, k, w, pairs, bias, y + r * ldy, ldy, cols, r == kTileRows ? prefetch : nullptr);
  const uint16_t* xr = x + r * k;
  uint16_t* yr = y + r * ldy;
  switch (rows - r) {
    case 1: tile<1, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    case 2: tile<2, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    case 3: tile<3, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    case 4: tile<4, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    case 5: tile<5, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    case 6: tile<6, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    case 7: tile<7, GROUPS>(xr, k, w, pairs, bias, yr, ldy, cols, nullptr); break;
    default: break;
  }
}

#endif

// x: (..., K) bf16; packed: pack_linear_bf16 of an (N, K) weight; bias: (N,) or None -> (..., N) bf16.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n) {
  KV_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && packed.scalar_type() == at::kBFloat16 &&
               packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 && packed.is_contiguous(),
           "x must be bfloat16 and packed a pack_linear_bf16 weight");
  const int64_t k = x.size(-1), pairs = packed.size(1);
  KV_CHECK(k >= 1 && pairs == (k + 1) / 2, "x has ", k, " features, the packed weight ", pairs, " pairs of them");
  KV_CHECK(n > 0 && (n + kGroup - 1) / kGroup == packed.size(0), "n = ", n, " does not match the packed weight's ",
           packed.size(0), " column groups");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    KV_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must have ", n, " elements");
    // Padded to whole groups so that a tile loads 16 lanes of it.
    bias_f = at::zeros({packed.size(0) * kGroup}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(*bias);
  }
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (rows == 0) return y;
#ifdef KVPOOL_AVX512_BF16
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.const_data_ptr());
  const float* bp = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const int64_t groups = packed.size(0), group_stride = pairs * kGroup * 2;
  const int64_t panels = (groups + kPanelGroups - 1) / kPanelGroups;
  const int64_t block = std::max<int64_t>(kTileRows, kRowBlockBytes / (2 * k) / kTileRows * kTileRows);
  const int64_t blocks = (rows + block - 1) / block;
  // Tasks are (row block, panel), panels innermost: a thread's share walks one row block's panels in
  // turn, the block's x staying in its L2.
  at::parallel_for(0, blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rb = t / panels, p = t % panels;
      const int64_t r0 = rb * block, nr = std::min(block, rows - r0);
      const int64_t g0 = p * kPanelGroups;
      const int ng = static_cast<int>(std::min<int64_t>(kPanelGroups, groups - g0));
      const int cols = static_cast<int>(std::min<int64_t>(kPanelGroups * kGroup, n - g0 * kGroup));
      const uint16_t* xb = xp + r0 * k;
      const uint16_t* wb = wp + g0 * group_stride;
      const float* bb = bp ? bp + g0 * kGroup : nullptr;
      uint16_t* yb = yp + r0 * n + g0 * kGroup;
      // The weights of the task after this one (the next panel; after the last, the next row block's first),
      // asked into L2 while this one computes: each task's first pass over its panel would otherwise wait
      // on memory (a model's weights do not stay in cache from one step to the next). Whole panels only.
      const int64_t next = t + 1 < blocks * panels ? (t + 1) % panels : -1;
      const uint16_t* pf = next >= 0 && (next + 1) * kPanelGroups <= groups ? wp + next * kPanelGroups * group_stride
                                                                           : nullptr;
      if (ng == 3) panel_rows<3>(nr, xb, k, wb, pairs, bb, yb, n, cols, pf);
      else if (ng == 2) panel_rows<2>(nr, xb, k, wb, pairs, bb, yb, n, cols, pf);
      else panel_rows<1>(nr, xb, k, wb, pairs, bb, yb, n, cols, pf);
    }
  });
#else
  KV_CHECK(false, "linear_bf16 needs AVX-512 BF16, which this build of the kernels lacks");
#endif
  return y;
}

bool linear_bf16_supported() {
#ifdef KVPOOL_AVX512_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool, m) {
  m.def("pack_linear_bf16(Tensor w) -> Tensor");
  m.impl("pack_linear_bf16", c10::DispatchKey::CPU, &pack_linear_bf16);
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CPU, &linear_bf16);
  m.def("linear_bf16_supported() -> bool", &linear_bf16_supported);
}
