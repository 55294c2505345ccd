// The attention half of a verification step, for few rows per request: the rotary embedding and
// KV write of every request's new rows in one call, and their attention over their own KV in one
// more. torch's path is ~15 ops a layer and one flash-attention call per request, each ~5-80 us of
// dispatch on these CPUs, more than the arithmetic of a tree's rows; batched steps pay it per
// request. See workers/small_gemm.py for when these run and the measured figures.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "simd.h"
#include <array>
#include <cmath>
#include <limits>
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
    const __m512 lo = load16(x + c, 0xFFFF), hi = load16(x + half + c, 0xFFFF);
    const __m512 a0 = round_as(_mm512_mul_ps(lo, load16(cos + c, 0xFFFF)), x);
    const __m512 b0 = round_as(_mm512_mul_ps(hi, load16(sin + c, 0xFFFF)), x);
    const __m512 a1 = round_as(_mm512_mul_ps(hi, load16(cos + half + c, 0xFFFF)), x);
    const __m512 b1 = round_as(_mm512_mul_ps(lo, load16(sin + half + c, 0xFFFF)), x);
    _mm512_storeu_ps(out + c, round_as(_mm512_add_ps(a0, b0), x));
    _mm512_storeu_ps(out + half + c, round_as(_mm512_add_ps(a1, b1), x));
  }
}

struct Seg {            // one request's rows in the packed step, and its KV of this layer
  float* k;             // [nkv, cap, D]
  float* v;
  int64_t cap, start, rows, length;
  const float* mask;    // [rows, rows] additive, among the new rows
  const float* past;    // [rows, length] additive over the cached slots, or null (all visible)
  bool causal;          // no new row sees a later one (a prefill): a row needs keys up to its own
};

template <typename X>
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
        rope_head<X>(row + (nq + h) * D, cos + r * D, sin + r * D, s.k + (h * s.cap + slot) * D, D);
        const X* v = row + (nq + nkv + h) * D;
        float* vo = s.v + (h * s.cap + slot) * D;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vo + d, load16(v + d, 0xFFFF));
      }
    }
  });
}

// ---- attention
// A task is one kv head of one request and up to 16 of its query rows, the g query heads that
// share the kv head stacked as rows (row i: head i / rows of the group, new row i % rows), so one
// vector holds a key's scores for all 16. Scores are kept transposed, [keys][16]: QK^T is then a
// small GEMM that broadcasts the keys' elements (no transpose of K), and softmax runs down the
// keys with the 16 rows in lanes.
constexpr int QB = 16;
constexpr int MK_MAX = 16;     // keys per scores block: 16 accumulators

// s[m][0:16] = scale * (k[m] . qt[:, 0:16]) for MK keys; qt: [D][16], k rows D apart.
template <int MK>
void scores_block(const float* k, const float* qt, int64_t D, float scale, float* s) {
  __m512 acc[MK];
  for (int m = 0; m < MK; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 qv = _mm512_loadu_ps(qt + d * QB);
    for (int m = 0; m < MK; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(k[m * D + d]), qv, acc[m]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int m = 0; m < MK; ++m) _mm512_storeu_ps(s + m * QB, _mm512_mul_ps(acc[m], sc));
}

// out[r][0:D] = sum_j p[j][i0 + r] v[j][0:D] for MR query rows, DV = D / 16 vectors a row.
template <int DV, int MR>
void pv_block(const float* p, int i0, const float* v, int64_t n, float* out) {
  __m512 acc[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[DV];
    for (int c = 0; c < DV; ++c) vj[c] = _mm512_loadu_ps(v + j * DV * 16 + c * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 pr = _mm512_set1_ps(p[j * QB + i0 + r]);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out + (r * DV + c) * 16, acc[r][c]);
}

using ScoresFn = void (*)(const float*, const float*, int64_t, float, float*);
using PvFn = void (*)(const float*, int, const float*, int64_t, float*);
template <size_t... I>
constexpr std::array<ScoresFn, sizeof...(I)> scores_table(std::index_sequence<I...>) {
  return {&scores_block<(int)I + 1>...};
}
template <int DV, size_t... I>
constexpr std::array<PvFn, sizeof...(I)> pv_table(std::index_sequence<I...>) {
  return {&pv_block<DV, (int)I + 1>...};
}

// One task: kv head h of segment s, folded query rows [i0, i0 + n). q: [T, nq, D] float32;
// out: [T, nq, D] in O. Rows whose every key is masked get zeros.
template <int DV, typename O>
void attend_task(const Seg& s, int64_t h, int64_t i0, int n, const float* q, int64_t nq, int64_t g,
                 float scale, O* out, std::vector<float>& buf) {
  constexpr int64_t D = DV * 16;
  constexpr int MR = 24 / DV;                    // 24 accumulators: MR rows x DV vectors
  static constexpr auto scores = scores_table(std::make_index_sequence<MK_MAX>{});
  static constexpr auto pv = pv_table<DV>(std::make_index_sequence<MR>{});
  int64_t end = s.length + s.rows;               // keys these rows may see
  if (s.causal) {
    int64_t last = 0;
    for (int i = 0; i < n; ++i) last = std::max(last, (i0 + i) % s.rows);
    end = s.length + last + 1;
  }
  buf.resize((size_t)(D * QB + end * QB + QB * D));
  float* qt = buf.data();                        // [D][16], rows past n zero
  float* sc = qt + D * QB;                       // [end][16] scores, then probabilities
  float* acc = sc + end * QB;                    // [16][D] unnormalized outputs
  std::fill(qt, qt + D * QB, 0.0f);
  for (int i = 0; i < n; ++i) {
    const int64_t fi = i0 + i, head = h * g + fi / s.rows, row = s.start + fi % s.rows;
    const float* qi = q + (row * nq + head) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * QB + i] = qi[d];
  }
  const float* k = s.k + h * s.cap * D;
  const float* v = s.v + h * s.cap * D;
  for (int64_t j = 0; j < end; j += MK_MAX) {
    const int mk = (int)std::min<int64_t>(MK_MAX, end - j);
    scores[mk - 1](k + j * D, qt, D, scale, sc + j * QB);
  }
  // masks: the cached slots (where given) and among the new rows, by each query row's new row
  for (int i = 0; i < n; ++i) {
    const int64_t t = (i0 + i) % s.rows;
    if (s.past)
      for (int64_t j = 0; j < s.length; ++j) sc[j * QB + i] += s.past[t * s.length + j];
    for (int64_t j = 0; j < end - s.length; ++j) sc[(s.length + j) * QB + i] += s.mask[t * s.rows + j];
  }
  // softmax down the keys, 16 query rows at once; a masked key (-inf) weighs exactly 0
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = ninf;
  for (int64_t j = 0; j < end; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + j * QB));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < end; ++j) {
    const __m512 x = _mm512_loadu_ps(sc + j * QB);
    const __mmask16 seen = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, mx)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(sc + j * QB, e);
  }
  alignas(64) float sums[QB];
  _mm512_store_ps(sums, sum);
  for (int r0 = 0; r0 < n; r0 += MR) {
    const int mr = std::min(MR, n - r0);
    pv[mr - 1](sc, r0, v, end, acc + r0 * D);
  }
  for (int i = 0; i < n; ++i) {
    const int64_t fi = i0 + i, head = h * g + fi / s.rows, row = s.start + fi % s.rows;
    const __m512 inv = _mm512_set1_ps(sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f);
    for (int64_t d = 0; d < D; d += 16)
      store16(out + (row * nq + head) * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + d), inv), 0xFFFF);
  }
}

template <int DV, typename O>
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
      attend_task<DV, O>(segs[t.seg], t.h, t.i0, t.n, q, nq, g, scale, out, buf);
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
    TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && k.scalar_type() == torch::kFloat32 &&
                vc[i].sizes() == k.sizes() && vc[i].is_contiguous() && vc[i].scalar_type() == torch::kFloat32,
                "KV caches: contiguous float32 [layers, kv_heads, capacity, head_dim]");
    TORCH_CHECK(layer >= 0 && layer < k.size(0) && k.size(1) == nkv && k.size(3) == D, "KV cache shape");
    const int64_t cap = k.size(2), layer_elems = nkv * cap * D;
    TORCH_CHECK(starts[i] >= 0 && rows[i] >= 0 && starts[i] + rows[i] <= T && lengths[i] >= 0 &&
                lengths[i] + rows[i] <= cap, "segment rows outside the step or the KV capacity");
    Seg s{k.data_ptr<float>() + layer * layer_elems, vc[i].data_ptr<float>() + layer * layer_elems,
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
// D a multiple of 32; k_caches / v_caches: each segment's float32 [layers, nkv, capacity, D].
// Writes segment i's roped keys and its values (rows starts[i]..+rows[i]) to layer `layer` at
// slots lengths[i]..; returns the roped queries, [T, nq, D] float32.
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kc,
                         std::vector<torch::Tensor> vc, int64_t layer, std::vector<int64_t> starts,
                         std::vector<int64_t> rows, std::vector<int64_t> lengths, int64_t nq, int64_t nkv) {
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "rope_store: contiguous tensors");
  TORCH_CHECK(nkv > 0 && nq % nkv == 0 && D % 32 == 0 && qkv.dim() == 2 && qkv.size(1) == (nq + 2 * nkv) * D &&
              cos.size(0) == T && sin.sizes() == cos.sizes(), "rope_store: shapes");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rope_store: dtypes");
  const auto segs = segments(kc, vc, layer, starts, rows, lengths, T, nkv, D, nullptr, nullptr, nullptr);
  auto q = torch::empty({T, nq, D}, qkv.options().dtype(torch::kFloat32));
  if (qkv.scalar_type() == torch::kFloat32) {
    rope_store_rows<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), segs, nq, nkv, D,
                           q.data_ptr<float>());
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16, "rope_store: float32 or bfloat16");
    using u16 = uint16_t;
    rope_store_rows<u16>(reinterpret_cast<const u16*>(qkv.data_ptr()), reinterpret_cast<const u16*>(cos.data_ptr()),
                         reinterpret_cast<const u16*>(sin.data_ptr()), segs, nq, nkv, D, q.data_ptr<float>());
  }
  return q;
}

// q [T, nq, D] float32 (rope_store's output), D 64 or 128; segment i's rows starts[i]..+rows[i]
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
  TORCH_CHECK(D == 64 || D == 128, "tree_attention: head_dim 64 or 128");
  TORCH_CHECK(!kc.empty(), "tree_attention: no segments");
  const int64_t nkv = kc[0].dim() == 4 ? kc[0].size(1) : 0;
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, "tree_attention: query heads a multiple of kv heads");
  const auto segs = segments(kc, vc, layer, starts, rows, lengths, T, nkv, D, &masks, &pasts, &causal);
  auto out = torch::empty({T, nq * D}, q.options().dtype(dtype));
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "tree_attention: float32 or bfloat16 output");
  using u16 = uint16_t;
  const float* qp = q.data_ptr<float>();
  if (dtype == torch::kFloat32) {
    float* o = out.data_ptr<float>();
    D == 64 ? attend_all<4, float>(segs, qp, nq, nkv, o) : attend_all<8, float>(segs, qp, nq, nkv, o);
  } else {
    u16* o = reinterpret_cast<u16*>(out.data_ptr());
    D == 64 ? attend_all<4, u16>(segs, qp, nq, nkv, o) : attend_all<8, u16>(segs, qp, nq, nkv, o);
  }
  return out;
}
