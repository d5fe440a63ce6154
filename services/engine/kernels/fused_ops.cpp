// Fused elementwise ops of a Llama-family layer for the CPU: RMSNorm (alone and after the residual
// add), SiLU-and-mul, and the rotary embedding, each one pass over its rows where the torch
// formulas take three to six (one full read and write of the activations per op; at 256 prompt
// tokens they were a third of a prefill's time in torch.profiler). vLLM's CPU backend fuses the
// same four (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding); these follow its
// signatures and semantics.
//
// Numerics: each op rounds to the tensor's dtype wherever the transformers module it replaces
// does (LlamaRMSNorm: float32 statistics, the normalised row cast back, then times the weight;
// SiLU then the product, each rounded; rotary: both products rounded, then their sum). In
// bfloat16 the results equal the reference's bit for bit in tests/engine/test_layer_ops.py (the
// variance's float32 sum runs in another order, which the rounding hides); in float32 they differ
// by an ulp where the compiler fuses a multiply-add or the sum's order differs.
// Rows are split over the calling thread's OpenMP team (a plain OpenMP loop, as in
// paged_attention.cpp, not at::parallel_for); the inner loops are plain float loops the compiler
// vectorises.
#include <torch/extension.h>
#include <omp.h>

#include "exp_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Storage types: float for float32, the raw bits (uint16_t) for bfloat16; c10::BFloat16's struct
// access keeps GCC from vectorising the loops, plain integers do not.
inline float load(float x) { return x; }
inline float load(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Rounds to the storage type: round-to-nearest-even for bfloat16 (c10's rule, NaN kept a NaN).
template <typename scalar_t>
inline scalar_t store(float x);
template <>
inline float store<float>(float x) { return x; }
template <>
inline uint16_t store<uint16_t>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7fc0u : rounded);
}

// The value after a round trip through scalar_t (identity for float32), for intermediates only:
// without store's NaN test (a quiet NaN stays a NaN; the final store canonicalises it).
template <typename scalar_t>
inline float round_as(float x) { return x; }
template <>
inline float round_as<uint16_t>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0, and 0 below -87 (where exp(x) nears the subnormals).
inline float exp_nonpositive(float x) { return x < -87.f ? 0.f : exp_clamped(x); }

// silu(g) = g / (1 + exp(-g)), through e = exp(-|g|) so that no lane ever computes a subnormal:
// GCC evaluates both sides of a clamp in vector code, and x / (1 + exp(88)) for an ordinary x is
// subnormal, which costs a microcode assist per lane (the plain formula measured 7x slower).
// Equal to torch's F.silu but for g in [-88.7, -87), where torch's result is below 1e-36 in size
// and this one is -0 (torch's is -0 below that band too).
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  return (g >= 0.f ? g : g * e) / (1.f + e);
}

// Sum of squares of one row in float32, lane-wise partial sums then a halving tree (both
// vectorise; see paged_attention.cpp's dot).
template <typename scalar_t>
inline float sum_squares(const scalar_t* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = load(x[i + l]);
      part[l] += v * v;
    }
  }
  for (; i < n; ++i) part[0] += load(x[i]) * load(x[i]);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  }
  return part[0];
}

// out = weight * cast(x * rsqrt(mean(x^2) + eps)), one row of n.
template <typename scalar_t>
inline void norm_row(scalar_t* out, const scalar_t* x, const scalar_t* weight, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = store<scalar_t>(load(weight[i]) * round_as<scalar_t>(load(x[i]) * inv));
  }
}

// Rows per thread below which a loop stays on the calling thread (a decode step's few rows).
constexpr int64_t kRowsPerThread = 4;

// The row loops, one template per op (OpenMP pragmas cannot sit inside AT_DISPATCH's lambda).
template <typename scalar_t>
void rms_norm_rows(scalar_t* out, int64_t out_stride, const scalar_t* x, int64_t x_stride, const scalar_t* weight,
                   int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 2 * kRowsPerThread)
  for (int64_t r = 0; r < rows; ++r) norm_row(out + r * out_stride, x + r * x_stride, weight, n, eps);
}

template <typename scalar_t>
void add_rms_norm_rows(scalar_t* x, scalar_t* residual, const scalar_t* weight, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 2 * kRowsPerThread)
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* xr = x + r * n;
    scalar_t* rr = residual + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) rr[i] = store<scalar_t>(load(rr[i]) + load(xr[i]));
    norm_row(xr, rr, weight, n, eps);
  }
}

template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, const scalar_t* gate_up, int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static) if (rows >= 2 * kRowsPerThread)
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* gate = gate_up + r * 2 * d;
    const scalar_t* up = gate + d;
    scalar_t* o = out + r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      const float g = load(gate[i]);
      o[i] = store<scalar_t>(round_as<scalar_t>(silu(g)) * load(up[i]));
    }
  }
}

// One row of causal scores in place: the first `valid` entries become softmax(scale * x) (float32
// max, exps and sum, each probability rounded once to the dtype, as transformers' eager attention
// rounds softmax(scores, dtype=float32)), the rest 0 (the keys after the query's position).
template <typename scalar_t>
inline void causal_softmax_row(scalar_t* __restrict x, int64_t valid, int64_t n, float scale) {
  float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
  for (int64_t i = 0; i < valid; ++i) peak = std::max(peak, load(x[i]) * scale);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < valid; ++i) sum += exp_nonpositive(load(x[i]) * scale - peak);
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < valid; ++i) x[i] = store<scalar_t>(exp_nonpositive(load(x[i]) * scale - peak) * inv);
  for (int64_t i = valid; i < n; ++i) x[i] = store<scalar_t>(0.f);
}

// One head's rotation: x1 = x[:half], x2 = x[half:] (restrict-qualified, so GCC vectorises it).
template <typename scalar_t>
inline void rotate_head(scalar_t* __restrict x1, scalar_t* __restrict x2, const scalar_t* __restrict c1,
                        const scalar_t* __restrict c2, const scalar_t* __restrict s1, const scalar_t* __restrict s2,
                        int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = load(x1[i]), b = load(x2[i]);
    x1[i] = store<scalar_t>(round_as<scalar_t>(a * load(c1[i])) + round_as<scalar_t>(-b * load(s1[i])));
    x2[i] = store<scalar_t>(round_as<scalar_t>(b * load(c2[i])) + round_as<scalar_t>(a * load(s2[i])));
  }
}

template <typename scalar_t>
void rotary_rows(scalar_t* qk, int64_t stride, const scalar_t* cos, const scalar_t* sin, int64_t rows, int64_t heads,
                 int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows >= 2 * kRowsPerThread)
  for (int64_t t = 0; t < rows; ++t) {
    const scalar_t* c = cos + t * head_dim;
    const scalar_t* s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      scalar_t* x = qk + t * stride + h * head_dim;
      rotate_head(x, x + half, c, c + half, s, s + half, half);
    }
  }
}

// Runs body<scalar_t>() with scalar_t the storage type of `dtype` (float32 or bfloat16).
template <typename Body>
void dispatch(at::ScalarType dtype, const char* name, Body body) {
  if (dtype == at::kFloat) {
    body(float{});
  } else if (dtype == at::kBFloat16) {
    body(uint16_t{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", dtype);
  }
}

template <typename scalar_t>
scalar_t* ptr(const torch::Tensor& t) {
  return reinterpret_cast<scalar_t*>(t.data_ptr());
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

int64_t row_stride(const torch::Tensor& t) { return t.dim() == 1 ? t.size(0) : t.stride(-2); }

}  // namespace

// out, x: [num_tokens, hidden_size] (rows may be strided, last dim contiguous); weight:
// [hidden_size]; one dtype. out = weight * (x / sqrt(mean(x^2) + eps)) (transformers' LlamaRMSNorm).
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "rms_norm: x, out must be [num_tokens, hidden_size]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight must be [hidden_size]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: x, out and weight differ in dtype");
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(ptr<scalar_t>(out), row_stride(out), ptr<scalar_t>(x), row_stride(x),
                            ptr<scalar_t>(weight), x.size(0), x.size(1), static_cast<float>(eps));
  });
}

// In place, vLLM's fused_add_rms_norm: residual = residual + x (rounded to the dtype, as the
// reference's `residual + hidden`), then x = rms_norm(residual). x, residual: [num_tokens,
// hidden_size] contiguous; weight: [hidden_size].
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && residual.is_contiguous(),
              "fused_add_rms_norm: x and residual must be contiguous CPU tensors");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(),
              "fused_add_rms_norm: x, residual must be [num_tokens, hidden_size]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1),
              "fused_add_rms_norm: weight must be [hidden_size]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: x, residual and weight differ in dtype");
  dispatch(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    add_rms_norm_rows<scalar_t>(ptr<scalar_t>(x), ptr<scalar_t>(residual), ptr<scalar_t>(weight),
                                x.size(0), x.size(1), static_cast<float>(eps));
  });
}

// out: [num_tokens, d]; gate_up: [num_tokens, 2 * d] (gate then up, as the fused gate_up_proj
// writes them). out = silu(gate) * up, each rounded to the dtype as torch's F.silu(gate) * up.
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && gate_up.is_contiguous(),
              "silu_and_mul: out and gate_up must be contiguous CPU tensors");
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && out.size(0) == gate_up.size(0) &&
                  gate_up.size(1) == 2 * out.size(1),
              "silu_and_mul: expected out [num_tokens, d] and gate_up [num_tokens, 2 * d]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "silu_and_mul: out and gate_up differ in dtype");
  dispatch(out.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_rows<scalar_t>(ptr<scalar_t>(out), ptr<scalar_t>(gate_up), out.size(0), out.size(1));
  });
}

// In place on qk: [num_tokens, num_heads, head_dim] (token rows may be strided, heads and
// head_dim contiguous); cos, sin: [num_tokens, head_dim] contiguous, the rotary module's
// output. x = x * cos + rotate_half(x) * sin (transformers' apply_rotary_pos_emb, the
// rotate-half layout of Llama and Qwen2), each product rounded to the dtype, then the sum.
void rotary_embedding(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qk.device().is_cpu() && qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "rotary_embedding: qk must be [num_tokens, num_heads, head_dim] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == qk.size(0) && cos.size(1) == qk.size(2),
              "rotary_embedding: cos, sin must be [num_tokens, head_dim], contiguous");
  TORCH_CHECK(qk.size(2) % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(qk.scalar_type() == cos.scalar_type() && qk.scalar_type() == sin.scalar_type(),
              "rotary_embedding: qk, cos and sin differ in dtype");
  dispatch(qk.scalar_type(), "rotary_embedding", [&](auto tag) {
    using scalar_t = decltype(tag);
    rotary_rows<scalar_t>(ptr<scalar_t>(qk), qk.stride(0), ptr<scalar_t>(cos), ptr<scalar_t>(sin),
                          qk.size(0), qk.size(1), qk.size(2));
  });
}

// In place on scores: [kv_heads, rows, group, keys] contiguous, the products of `rows` queries
// (each with `group` heads) with `keys` keys, query r at position first_position + r seeing keys
// 0 .. first_position + r. Each row becomes its causal softmax of scale * scores (float32
// inside, rounded once to the dtype), zero past the query's position
// (services/engine/attention/blocked_prefill.py).
void causal_softmax(torch::Tensor scores, double scale, int64_t first_position) {
  TORCH_CHECK(scores.device().is_cpu() && scores.is_contiguous() && scores.dim() == 4,
              "causal_softmax: scores must be a contiguous CPU tensor [kv_heads, rows, group, keys]");
  const int64_t heads = scores.size(0), rows = scores.size(1), group = scores.size(2), keys = scores.size(3);
  TORCH_CHECK(first_position >= 0 && first_position + rows <= keys,
              "causal_softmax: the rows' positions must lie within the keys");
  dispatch(scores.scalar_type(), "causal_softmax", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* base = ptr<scalar_t>(scores);
    const int64_t total = heads * rows * group;
#pragma omp parallel for schedule(static)
    for (int64_t line = 0; line < total; ++line) {
      const int64_t r = (line / group) % rows;
      causal_softmax_row<scalar_t>(base + line * keys, first_position + r + 1, keys, static_cast<float>(scale));
    }
  });
}
