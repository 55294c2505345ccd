// The attention half of a verification step, for few rows per request: the rotary embedding and
// KV write of every request's new rows in one call, and their attention over their own KV in one
// more. torch's path is ~15 ops a layer and one flash-attention call per request, each ~5-80 us of
// dispatch on these CPUs, more than the arithmetic of a tree's rows; batched steps pay it per
// request. See workers/model/small_gemm.py for when these run and the measured figures.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "simd.h"
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace specgate_simd;

// ---- rope + KV write

// x * cos + roll(x, D/2) * sin_signed for one head (rotate_half's sign is in sin), D % 32 == 0;
// rounded as torch's separate multiplies and add would be in x's dtype, then stored as float32.
template <typename X>
inline void rope_head(const X* x, const X* cos, const X* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t c = 0; c < half; c += 16) {
    const vf lo = load16(x + c, kAll), hi = load16(x + half + c, kAll);
    const vf a0 = round_as(vmul(lo, load16(cos + c, kAll)), x);
    const vf b0 = round_as(vmul(hi, load16(sin + c, kAll)), x);
    const vf a1 = round_as(vmul(hi, load16(cos + half + c, kAll)), x);
    const vf b1 = round_as(vmul(lo, load16(sin + half + c, kAll)), x);
    vstoreu(out + c, round_as(vadd(a0, b0), x));
    vstoreu(out + half + c, round_as(vadd(a1, b1), x));
  }
}

struct Seg {            // one request's rows in the packed step, and its KV of this layer
  void* k;              // [nkv, cap, D], float32 or bf16 (every segment the same)
  void* v;
  int64_t cap, start, rows, length;
  const float* mask;    // [rows, rows] additive, among the new rows
  const float* past;    // [rows, length] additive over the cached slots, or null (all visible)
  bool causal;          // no new row sees a later one (a prefill): a row needs keys up to its own
};

template <typename X, typename KV>
void rope_store_rows(const X* qkv, const X* cos, const X* sin, const std::vector<Seg>& segs,
                     int64_t nq, int64_t nkv, int64_t D, float* q) {
  const int64_t W = (nq + 2 * nkv) * D;
  std::vector<std::pair<const Seg*, int64_t>> rows;           // (segment, new row): split between threads
  for (const Seg& s : segs)
    for (int64_t t = 0; t < s.rows; ++t) rows.emplace_back(&s, t);
  at::parallel_for(0, (int64_t)rows.size(), 8, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const Seg& s = *rows[i].first;
      const int64_t t = rows[i].second, r = s.start + t, slot = s.length + t;
      const X* row = qkv + r * W;
      for (int64_t h = 0; h < nq; ++h) rope_head<X>(row + h * D, cos + r * D, sin + r * D, q + (r * nq + h) * D, D);
      for (int64_t h = 0; h < nkv; ++h) {
        alignas(64) float key[256];                  // D <= 256 (checked)
        rope_head<X>(row + (nq + h) * D, cos + r * D, sin + r * D, key, D);
        const X* v = row + (nq + nkv + h) * D;
        KV* ko = static_cast<KV*>(s.k) + (h * s.cap + slot) * D;
        KV* vo = static_cast<KV*>(s.v) + (h * s.cap + slot) * D;
        for (int64_t d = 0; d < D; d += 16) {
          store16(ko + d, vloadu(key + d), kAll);
          store16(vo + d, load16(v + d, kAll), kAll);
        }
      }
    }
  });
}

// ---- attention
// A task is one kv head of one request and up to 16 of its query rows, the g query heads that
// share the kv head stacked as rows (row i: head i / rows of the group, new row i % rows).
// Scores are [row][keys], each row's dot products with 16 keys at a time reduced from 16
// partial-sum vectors into one vector of 16 scores: ~11 instructions a key and row. (Tried: the
// scores transposed, [keys][16 rows], QK^T as a small GEMM broadcasting the keys' elements: ~130
// instructions a key whatever the rows, so 1.5x slower for 8 requests of 1 row (656 against 431
// us a layer), and no faster for 16 rows or prefills.)
constexpr int QB = 16;         // query rows a task
// KV_PREFETCH: keys and values are read ahead into L1 by hand: a batched step reads each
// request's KV from memory once a layer, and the hardware prefetcher alone left ~10% of the time
// waiting (8 requests x 4 rows, ~440 tokens of context each, 30 layers cycled: 535 -> 475 us a
// layer; 1 request unchanged).

// out[r][0:D] = sum_j p[i0 + r][j] v[j][0:D] for MR query rows (p rows si apart), DV = D / 16
// vectors a row.
template <int DV, int MR, typename KV>
void pv_block(const float* p, int i0, const KV* v, int64_t n, float* out, int64_t si) {
  vf acc[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    for (int c = 0; c < DV; ++c)         // the values 16 keys ahead (see KV_PREFETCH)
      _mm_prefetch((const char*)(v + (j + 16) * DV * 16 + c * 16), _MM_HINT_T0);
    vf vj[DV];
    for (int c = 0; c < DV; ++c) vj[c] = load16(v + j * DV * 16 + c * 16, kAll);
    for (int r = 0; r < MR; ++r) {
      const vf pr = vset1(p[(i0 + r) * si + j]);
      for (int c = 0; c < DV; ++c) acc[r][c] = vfmadd(pr, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) vstoreu(out + (r * DV + c) * 16, acc[r][c]);
}

template <typename KV>
using PvFn = void (*)(const float*, int, const KV*, int64_t, float*, int64_t);
template <int DV, typename KV, size_t... I>
constexpr std::array<PvFn<KV>, sizeof...(I)> pv_table(std::index_sequence<I...>) {
  return {&pv_block<DV, (int)I + 1, KV>...};
}

// s[i][j] = scale * (q_i . k[j]) for n query rows (pointers qs) and `end` keys (k rows D apart),
// s rows si apart. K stays in L1 across the rows of a block of 16 keys.
template <int DV, typename KV>
void scores_rows(const KV* k, int64_t end, const float* const* qs, int n, float scale, float* s, int64_t si) {
  constexpr int64_t D = DV * 16;
  alignas(64) float tail[16 * D];
  const vf sc = vset1(scale);
  for (int64_t j0 = 0; j0 < end; j0 += 16) {
    const int mk = (int)std::min<int64_t>(16, end - j0);
    const KV* kj = k + j0 * D;
    for (int64_t l = 0; l < D * (int64_t)sizeof(KV) / 4; ++l)   // the keys two blocks ahead (see KV_PREFETCH)
      _mm_prefetch((const char*)(kj + 32 * D) + 64 * l, _MM_HINT_T0);
    const float* kb;
    if (std::is_same<KV, float>::value && mk == 16) {
      kb = reinterpret_cast<const float*>(kj);
    } else {                             // bf16 keys as float32 once for all rows; the last keys
      for (int m = 0; m < 16; ++m)       // zero-padded (never read past the cache)
        for (int64_t d = 0; d < D; d += 16)
          vstoreu(tail + m * D + d, m < mk ? load16(kj + m * D + d, kAll) : vzero());
      kb = tail;
    }
    for (int i = 0; i < n; ++i) {
      vf qv[DV], acc[16];
      for (int c = 0; c < DV; ++c) qv[c] = vloadu(qs[i] + 16 * c);
      for (int m = 0; m < 16; ++m) {
        acc[m] = vmul(qv[0], vloadu(kb + m * D));
        for (int c = 1; c < DV; ++c) acc[m] = vfmadd(qv[c], vloadu(kb + m * D + 16 * c), acc[m]);
      }
      store16(s + i * si + j0, vmul(reduce16(acc), sc), tail_mask(mk));
    }
  }
}

// In place over a row of scores: e^(s - max) (exactly 0 where s is -inf); returns the sum.
inline float softmax_row(float* s, int64_t end) {
  const float ninf = -std::numeric_limits<float>::infinity();
  vf mx = vset1(ninf);
  for (int64_t j = 0; j < end; j += 16) mx = vmax(mx, load16_or(s + j, tail_mask((int)std::min<int64_t>(16, end - j)), ninf));
  const float top = reduce_max(mx);
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + end, 0.0f);
    return 0.0f;
  }
  const vf m = vset1(top);
  vf sum = vzero();
  for (int64_t j = 0; j < end; j += 16) {
    const vmask t = tail_mask((int)std::min<int64_t>(16, end - j));
    const vf x = load16_or(s + j, t, ninf);
    const vf e = zero_where_neg_inf(x, exp16(vsub(x, m)));
    sum = vadd(sum, e);
    store16(s + j, e, t);
  }
  return reduce_add(sum);
}

// One task: kv head h of segment s, folded query rows [i0, i0 + n). q: [T, nq, D] float32;
// out: [T, nq, D] in O. Rows whose every key is masked get zeros.
template <int DV, typename KV, typename O>
void attend_task(const Seg& s, int64_t h, int64_t i0, int n, const float* q, int64_t nq, int64_t g,
                 float scale, O* out, std::vector<float>& buf) {
  constexpr int64_t D = DV * 16;
  // up to 24 accumulators with AVX-512's 32 registers (MR rows x DV vectors; D 256: 1 x 16), up
  // to 6 vectors (12 registers) with AVX2's 16
  constexpr int MR = kWide ? 24 / DV : (6 / DV > 0 ? 6 / DV : 1);
  static constexpr auto pv = pv_table<DV, KV>(std::make_index_sequence<MR>{});
  int64_t end = s.length + s.rows;               // keys these rows may see
  if (s.causal) {
    int64_t last = 0;
    for (int i = 0; i < n; ++i) last = std::max(last, (i0 + i) % s.rows);
    end = s.length + last + 1;
  }
  const int64_t si = (end + 15) / 16 * 16;      // score row stride
  buf.resize((size_t)(QB * si + QB * D));
  float* sc = buf.data();                        // [16][si] scores, then probabilities
  float* acc = sc + QB * si;                     // [16][D] unnormalized outputs
  const float* qs[QB];                           // each row's query
  for (int i = 0; i < n; ++i) {
    const int64_t fi = i0 + i, head = h * g + fi / s.rows, row = s.start + fi % s.rows;
    qs[i] = q + (row * nq + head) * D;
  }
  const KV* k = static_cast<const KV*>(s.k) + h * s.cap * D;
  const KV* v = static_cast<const KV*>(s.v) + h * s.cap * D;
  scores_rows<DV, KV>(k, end, qs, n, scale, sc, si);
  // masks: the cached slots (where given) and among the new rows, by each query row's new row
  for (int i = 0; i < n; ++i) {
    const int64_t t = (i0 + i) % s.rows;
    if (s.past)
      for (int64_t j = 0; j < s.length; ++j) sc[i * si + j] += s.past[t * s.length + j];
    for (int64_t j = 0; j < end - s.length; ++j) sc[i * si + s.length + j] += s.mask[t * s.rows + j];
  }
  // softmax over each row's keys; a masked key (-inf) weighs exactly 0
  float sums[QB];
  for (int i = 0; i < n; ++i) sums[i] = softmax_row(sc + i * si, end);
  for (int r0 = 0; r0 < n; r0 += MR) {
    const int mr = std::min(MR, n - r0);
    pv[mr - 1](sc, r0, v, end, acc + r0 * D, si);
  }
  for (int i = 0; i < n; ++i) {
    const int64_t fi = i0 + i, head = h * g + fi / s.rows, row = s.start + fi % s.rows;
    const vf inv = vset1(sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f);
    for (int64_t d = 0; d < D; d += 16)
      store16(out + (row * nq + head) * D + d, vmul(vloadu(acc + i * D + d), inv), kAll);
  }
}

template <int DV, typename KV, typename O>
void attend_all(const std::vector<Seg>& segs, const float* q, int64_t nq, int64_t nkv, O* out) {
  const int64_t g = nq / nkv;
  const float scale = 1.0f / std::sqrt((float)(DV * 16));
  struct Task { int seg; int64_t h, i0; int n; };
  std::vector<Task> tasks;
  for (int si = 0; si < (int)segs.size(); ++si)
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t i0 = 0; i0 < g * segs[si].rows; i0 += QB)
        tasks.push_back({si, h, i0, (int)std::min<int64_t>(QB, g * segs[si].rows - i0)});
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t a, int64_t b) {
    thread_local std::vector<float> buf;
    for (int64_t ti = a; ti < b; ++ti) {
      const Task& t = tasks[ti];
      attend_task<DV, KV, O>(segs[t.seg], t.h, t.i0, t.n, q, nq, g, scale, out, buf);
    }
  });
}

std::vector<Seg> segments(std::vector<torch::Tensor>& kc, std::vector<torch::Tensor>& vc, int64_t layer,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& rows,
                          const std::vector<int64_t>& lengths, int64_t T, int64_t nkv, int64_t D,
                          const std::vector<torch::Tensor>* masks, const std::vector<torch::Tensor>* pasts,
                          const std::vector<bool>* causal) {
  const size_t n = kc.size();
  TORCH_CHECK(vc.size() == n && starts.size() == n && rows.size() == n && lengths.size() == n &&
              (!masks || masks->size() == n) && (!pasts || pasts->size() == n) && (!causal || causal->size() == n),
              "one entry per segment");
  std::vector<Seg> segs;
  for (size_t i = 0; i < n; ++i) {
    const torch::Tensor& k = kc[i];
    TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) &&
                vc[i].sizes() == k.sizes() && vc[i].is_contiguous() && vc[i].scalar_type() == k.scalar_type() &&
                k.scalar_type() == kc[0].scalar_type(),
                "KV caches: contiguous [layers, kv_heads, capacity, head_dim], all float32 or all bf16");
    TORCH_CHECK(layer >= 0 && layer < k.size(0) && k.size(1) == nkv && k.size(3) == D, "KV cache shape");
    const int64_t cap = k.size(2), at = layer * nkv * cap * D * (int64_t)k.element_size();   // bytes
    TORCH_CHECK(starts[i] >= 0 && rows[i] >= 0 && starts[i] + rows[i] <= T && lengths[i] >= 0 &&
                lengths[i] + rows[i] <= cap, "segment rows outside the step or the KV capacity");
    Seg s{static_cast<char*>(k.data_ptr()) + at, static_cast<char*>(vc[i].data_ptr()) + at,
          cap, starts[i], rows[i], lengths[i], nullptr, nullptr, causal && (*causal)[i]};
    if (masks) {
      const torch::Tensor& m = (*masks)[i];
      TORCH_CHECK(m.scalar_type() == torch::kFloat32 && m.is_contiguous() && m.dim() == 2 &&
                  m.size(0) == rows[i] && m.size(1) == rows[i], "mask: contiguous float32 [rows, rows]");
      s.mask = m.data_ptr<float>();
      const torch::Tensor& p = (*pasts)[i];
      if (p.numel()) {
        TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.is_contiguous() && p.dim() == 2 &&
                    p.size(0) == rows[i] && p.size(1) == lengths[i], "past: contiguous float32 [rows, length]");
        s.past = p.data_ptr<float>();
      }
    }
    if (rows[i] > 0) segs.push_back(s);
  }
  return segs;
}

}  // namespace

// qkv [T, (nq + 2 nkv) D] and cos / sin_signed [T, D] in the model's dtype (float32 or bf16),
// D a multiple of 32; k_caches / v_caches: each segment's [layers, nkv, capacity, D], all float32
// or all bf16 (the keys rounded once, after the rope).
// Writes segment i's roped keys and its values (rows starts[i]..+rows[i]) to layer `layer` at
// slots lengths[i]..; returns the roped queries, [T, nq, D] float32.
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kc,
                         std::vector<torch::Tensor> vc, int64_t layer, std::vector<int64_t> starts,
                         std::vector<int64_t> rows, std::vector<int64_t> lengths, int64_t nq, int64_t nkv) {
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "rope_store: contiguous tensors");
  TORCH_CHECK(nkv > 0 && nq % nkv == 0 && D % 32 == 0 && D <= 256 && qkv.dim() == 2 && qkv.size(1) == (nq + 2 * nkv) * D &&
              cos.size(0) == T && sin.sizes() == cos.sizes(), "rope_store: shapes");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rope_store: dtypes");
  const auto segs = segments(kc, vc, layer, starts, rows, lengths, T, nkv, D, nullptr, nullptr, nullptr);
  auto q = torch::empty({T, nq, D}, qkv.options().dtype(torch::kFloat32));
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 || qkv.scalar_type() == torch::kBFloat16,
              "rope_store: float32 or bfloat16");
  using u16 = uint16_t;
  const bool xf = qkv.scalar_type() == torch::kFloat32, kf = kc.empty() || kc[0].scalar_type() == torch::kFloat32;
#define RS(X, KV) rope_store_rows<X, KV>(reinterpret_cast<const X*>(qkv.data_ptr()), reinterpret_cast<const X*>(cos.data_ptr()), \
    reinterpret_cast<const X*>(sin.data_ptr()), segs, nq, nkv, D, q.data_ptr<float>())
  if (xf && kf) RS(float, float); else if (!xf && kf) RS(u16, float); else if (!xf && !kf) RS(u16, u16); else RS(float, u16);
#undef RS
  return q;
}

// q [T, nq, D] float32 (rope_store's output), D 32, 64, 96, 128 or 256 (HEAD_DIMS in
// workers/model/small_gemm.py); segment i's rows starts[i]..+rows[i]
// attend to slots [0, lengths[i] + rows[i]) of its layer-`layer` KV (their own KV written there
// already), with masks[i] [rows, rows] among the new rows and pasts[i] [rows, lengths[i]] over the
// cached slots (empty: all visible), both additive float32. Returns [T, nq D] in `dtype`; rows of
// no segment are left unset.
torch::Tensor tree_attention(torch::Tensor q, std::vector<torch::Tensor> kc, std::vector<torch::Tensor> vc,
                             int64_t layer, std::vector<int64_t> starts, std::vector<int64_t> rows,
                             std::vector<int64_t> lengths, std::vector<torch::Tensor> masks,
                             std::vector<torch::Tensor> pasts, std::vector<bool> causal, c10::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: contiguous float32 [T, nq, D]");
  const int64_t T = q.size(0), nq = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 32 || D == 64 || D == 96 || D == 128 || D == 256, "tree_attention: head_dim 32, 64, 96, 128 or 256");
  TORCH_CHECK(!kc.empty(), "tree_attention: no segments");
  const int64_t nkv = kc[0].dim() == 4 ? kc[0].size(1) : 0;
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, "tree_attention: query heads a multiple of kv heads");
  const auto segs = segments(kc, vc, layer, starts, rows, lengths, T, nkv, D, &masks, &pasts, &causal);
  auto out = torch::empty({T, nq * D}, q.options().dtype(dtype));
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "tree_attention: float32 or bfloat16 output");
  using u16 = uint16_t;
  const float* qp = q.data_ptr<float>();
  const bool kf = kc[0].scalar_type() == torch::kFloat32, of = dtype == torch::kFloat32;
#define ATT(DV, KV, O) attend_all<DV, KV, O>(segs, qp, nq, nkv, reinterpret_cast<O*>(out.data_ptr()))
#define ATT_D(DV) do { \
    if (kf) { if (of) ATT(DV, float, float); else ATT(DV, float, u16); } \
    else    { if (of) ATT(DV, u16, float);   else ATT(DV, u16, u16); } } while (0)
  switch (D) {
    case 32: ATT_D(2); break;
    case 64: ATT_D(4); break;
    case 96: ATT_D(6); break;
    case 128: ATT_D(8); break;
    default: ATT_D(16); break;   // 256, the only other size checked above
  }
#undef ATT_D
#undef ATT
  return out;
}
