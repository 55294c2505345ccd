// A whole tree step's decoder layers in one call: the same kernels the Python loop calls one by
// one (RMSNorm + residual add, few-row linears, rope + KV write, tree attention, SwiGLU), without
// its ~10 Python calls a layer (~25 us a layer on these CPUs, ~1 ms a SmolLM2 step). And the
// greedy argmax of a step's logits rows. See workers/model/small_gemm.py for when these run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "simd.h"
#include <limits>
#include <vector>

namespace {

// One layer's weights as workers/model/llama_forward.py holds them: norms in the model's dtype, the
// linears packed for the few-row kernel (small_gemm.pack), each linear's bias float32 or empty,
// and Qwen3's per-head q/k norm weights [D] in the model's dtype or empty.
struct LayerWeights {
  torch::Tensor ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wdown, bdown, qn, kn;
};

class LayerStack {
 public:
  LayerStack(std::vector<std::vector<torch::Tensor>> layers, int64_t nq, int64_t nkv, int64_t head_dim,
             int64_t hidden, int64_t intermediate, double eps)
      : nq_(nq), nkv_(nkv), d_(head_dim), hidden_(hidden), inter_(intermediate), eps_(eps) {
    for (auto& w : layers) {
      TORCH_CHECK(w.size() == 12, "LayerStack: per layer ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wdown, bdown, qn, kn");
      layers_.push_back({w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11]});
    }
  }

  // x [T, H] (the residual stream, updated in place) -> the last layer's MLP output [T, H], not yet
  // added to x; with `logits` false (a prefill), stops after the last layer's KV write and
  // returns an empty tensor. The other arguments as tree_attention's (every segment attends
  // through the kernel here).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kc,
                        std::vector<torch::Tensor> vc, std::vector<int64_t> starts, std::vector<int64_t> rows,
                        std::vector<int64_t> lengths, std::vector<torch::Tensor> masks,
                        std::vector<torch::Tensor> pasts, std::vector<bool> causal, bool logits) {
    const auto dtype = x.scalar_type();
    const int64_t n_qkv = (nq_ + 2 * nkv_) * d_;
    torch::Tensor delta = torch::empty({0}, x.options());
    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights& w = layers_[li];
      auto h = rms_norm(x, delta, w.ln1, eps_);                                   // x += delta first
      auto qkv = linear(h, w.wqkv, n_qkv, w.bqkv);                               // [T, (Hq+2Hkv)D]
      if (w.qn.numel()) {   // Qwen3: RMSNorm over each query and key head before the rope (ATen's, as the loop)
        auto heads = qkv.view({qkv.size(0), nq_ + 2 * nkv_, d_});
        heads.narrow(1, 0, nq_).copy_(at::rms_norm(heads.narrow(1, 0, nq_), {d_}, w.qn, eps_));
        heads.narrow(1, nq_, nkv_).copy_(at::rms_norm(heads.narrow(1, nq_, nkv_), {d_}, w.kn, eps_));
      }
      auto q = rope_store(qkv, cos, sin, kc, vc, (int64_t)li, starts, rows, lengths, nq_, nkv_);   // [T, Hq, D]
      if (!logits && li + 1 == layers_.size()) return torch::empty({0}, x.options());
      auto att = tree_attention(q, kc, vc, (int64_t)li, starts, rows, lengths, masks, pasts, causal, dtype);
      h = rms_norm(x, linear(att, w.wo, hidden_, w.bo), w.ln2, eps_);            // x += attention out
      delta = linear(silu_mul(linear(h, w.wgu, 2 * inter_, w.bgu)), w.wdown, hidden_, w.bdown);
    }
    return delta;
  }

 private:
  std::vector<LayerWeights> layers_;
  int64_t nq_, nkv_, d_, hidden_, inter_;
  double eps_;
};

// Index of each row's largest value, the first where several are equal (as torch.argmax).
template <typename T>
void argmax_rows_impl(const T* x, int64_t R, int64_t V, int64_t* out) {
  using namespace specgate_simd;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * V;
      // per lane: the best value and the first index holding it
      vf best = vset1(-std::numeric_limits<float>::infinity());
      vi at = vi_zero(), idx = vi_iota();
      for (int64_t i = 0; i < V; i += 16) {
        const vmask m = tail_mask((int)std::min<int64_t>(16, V - i));
        keep_greater(best, at, load16(row + i, m), idx, m);
        idx = vi_add16(idx);
      }
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      vstoreu(bv, best);
      vi_storeu(bi, at);
      float top = bv[0];
      int64_t arg = bi[0];
      for (int l = 1; l < 16; ++l)
        if (bv[l] > top || (bv[l] == top && bi[l] < arg)) { top = bv[l]; arg = bi[l]; }
      out[r] = arg;
    }
  });
}

}  // namespace

// x [R, V] float32 or bf16 -> [R] int64: the index of each row's largest value (the first of
// equals; NaN is never chosen, unlike torch.argmax, and a row of NaN or -inf gives 0).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "argmax_rows: a contiguous [R, V] matrix");
  TORCH_CHECK(x.size(1) < (int64_t)1 << 31, "argmax_rows: rows up to 2^31 values");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  if (x.scalar_type() == torch::kFloat32) {
    argmax_rows_impl<float>(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "argmax_rows: float32 or bfloat16");
    argmax_rows_impl<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.size(1),
                               out.data_ptr<int64_t>());
  }
  return out;
}

void register_decoder(pybind11::module& m) {
  pybind11::class_<LayerStack>(m, "LayerStack")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, int64_t, int64_t, int64_t, int64_t, int64_t,
                          double>())
      .def("forward", &LayerStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
