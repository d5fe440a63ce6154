// The Python module of pdserve's CPU kernels (services/engine/kernels/__init__.py builds it).
#include <torch/extension.h>

#include <cstdint>
#include <vector>

// paged_attention.cpp
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale);
// fused_ops.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void rotary_embedding(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin);
void causal_softmax(torch::Tensor scores, double scale, int64_t first_position);
// threads.cpp
std::vector<int64_t> pin_omp_threads(const std::vector<int64_t>& cpu_ids);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight (transformers' LlamaRMSNorm)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "In place: residual += x; x = RMSNorm(residual)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up of [gate | up]");
  m.def("rotary_embedding", &rotary_embedding, "In place: rotate-half rotary embedding of q and k");
  m.def("causal_softmax", &causal_softmax, "In place: each row's causal softmax of scale * scores");
  m.def("pin_omp_threads", &pin_omp_threads, "Pin the caller's OpenMP team, member i to CPU i");
}
