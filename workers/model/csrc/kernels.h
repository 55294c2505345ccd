// The extension's entry points, shared by the sources that call each other (decoder.cpp runs the
// others) and by the module definition (small_gemm.cpp). Each is documented where it is defined.
#pragma once

#include <torch/extension.h>
#include <vector>

// small_gemm.cpp
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);

// attention.cpp
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kc,
                         std::vector<torch::Tensor> vc, int64_t layer, std::vector<int64_t> starts,
                         std::vector<int64_t> rows, std::vector<int64_t> lengths, int64_t nq, int64_t nkv);
torch::Tensor tree_attention(torch::Tensor q, std::vector<torch::Tensor> kc, std::vector<torch::Tensor> vc,
                             int64_t layer, std::vector<int64_t> starts, std::vector<int64_t> rows,
                             std::vector<int64_t> lengths, std::vector<torch::Tensor> masks,
                             std::vector<torch::Tensor> pasts, std::vector<bool> causal, c10::ScalarType dtype);

// decoder.cpp: the LayerStack class and argmax_rows, added to the module
void register_decoder(pybind11::module& m);
