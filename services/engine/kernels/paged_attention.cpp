// Paged decode attention for the CPU: one query token per request, reading K/V straight out of
// the paged cache through each request's block table (no gathered copy of the context).
//
// Layout (services/engine/kv_cache.py): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; position p of request b lives at block block_tables[b][p / block_size], offset
// p % block_size. Work is split over requests with at::parallel_for; each request computes the
// scores of every query head against every position, a float32 softmax, and the weighted sum of
// V, in two passes over its context (the scheme of vLLM's CPU
// paged_attention_v1 kernel, without its hand-written intrinsics: the inner loops are plain
// contiguous float loops the compiler vectorises).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// One request, all its heads. Each position's K (then V) row [num_kv_heads, head_dim] is
// contiguous, and a block holds block_size such rows back to back, so both passes stream through
// the request's blocks in order.
template <typename scalar_t>
void decode_one(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                const int64_t* block_table, int64_t context_len, int64_t block_size,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                float* qf, float* scores, float* acc, scalar_t* out) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_size = num_kv_heads * head_dim;  // elements of one position's K or V row
  for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  // Pass 1: scores[h][p] = (q_h . k_p) * scale, k_p taken from head h's KV head.
  for (int64_t p = 0; p < context_len; ++p) {
    const scalar_t* row = k_cache + (block_table[p / block_size] * block_size + p % block_size) * row_size;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* qh = qf + h * head_dim;
      const scalar_t* k = row + (h / group) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(k[d]);
      scores[h * context_len + p] = dot;
    }
  }
  // Softmax per query head, in float32.
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * context_len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < context_len; ++p) max_score = std::max(max_score, s[p]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < context_len; ++p) {
      s[p] = std::exp(s[p] - max_score);
      sum += s[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < context_len; ++p) s[p] *= inv;
  }
  // Pass 2: out_h = sum_p probs[h][p] * v_p.
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t p = 0; p < context_len; ++p) {
    const scalar_t* row = v_cache + (block_table[p / block_size] * block_size + p % block_size) * row_size;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float w = scores[h * context_len + p];
      const scalar_t* v = row + (h / group) * head_dim;
      float* a = acc + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * to_float(v[d]);
    }
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

template <typename scalar_t>
void decode_all(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                const torch::Tensor& context_lens, double scale) {
  const int64_t num_decodes = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, num_decodes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t b = begin; b < end; ++b) {
      scores.resize(num_heads * lens[b]);
      const int64_t offset = b * num_heads * head_dim;
      decode_one<scalar_t>(q_ptr + offset, k_ptr, v_ptr, tables + b * max_blocks, lens[b], block_size,
                           num_heads, num_kv_heads, head_dim, static_cast<float>(scale), qf.data(),
                           scores.data(), acc.data(), out_ptr + offset);
    }
  });
}

// out, q: [num_decodes, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
// num_kv_heads, head_dim]; block_tables: [num_decodes, max_blocks] int64; context_lens:
// [num_decodes] int64 (including the new token). All contiguous, on the CPU, one dtype.
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_all<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
