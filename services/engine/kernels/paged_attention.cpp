// Paged decode attention for the CPU: one query token per request, reading K/V straight out of
// the paged cache through each request's block table (no gathered copy of the context).
//
// Layout (services/engine/kv_cache.py): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; position p of request b lives at block block_tables[b][p / block_size], offset
// p % block_size. Work is split over requests with an OpenMP loop; each request computes the
// scores of every query head against every position, a float32 softmax, and the weighted sum of
// V, in two passes over its context (the scheme of vLLM's CPU paged_attention_v1 kernel, without
// its hand-written intrinsics: the inner loops are plain contiguous float loops the compiler
// vectorises). With fewer requests than threads, their contexts are split into parts merged
// afterwards (paged_attention_v2's scheme), so one long request uses every thread.
#include <torch/extension.h>
#include <omp.h>

#include "exp_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxHeads = 256;

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
// Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary:
// ask for the next block while this one is being read.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* ptr, int64_t num_elements) {
  const char* bytes = reinterpret_cast<const char*>(ptr);
  for (int64_t offset = 0; offset < num_elements * static_cast<int64_t>(sizeof(scalar_t)); offset += 64) {
    __builtin_prefetch(bytes + offset);
  }
}

// The softmax's x <= 0: smaller terms than exp(-87) vanish next to the max's 1.
inline float softmax_exp(float x) { return exp_clamped(x); }

// q . k over head_dim. Lane-wise partial sums, then a halving tree: both vectorise, where a
// plain reduction loop ends in one scalar add per lane (measured 3x slower).
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t head_dim) {
  constexpr int64_t kLanes = 16;
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) part[l] += q[d + l] * to_float(k[d + l]);
  }
  for (; d < head_dim; ++d) part[0] += q[d] * to_float(k[d]);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  }
  return part[0];
}

// out_h = sum_p w[h][p - first] * v_p over a request's positions [first, last) (first: a
// block's start, so they are its blocks first / block_size on), one query head at a time with
// its HD sums in registers; the request's V rows stay in L2 between the heads of a group.
template <typename scalar_t, int64_t HD, typename out_t>
void weighted_sum(const float* scores, const scalar_t* v_cache, const int64_t* block_table, int64_t first,
                  int64_t last, int64_t block_size, int64_t row_size, int64_t num_heads, const int64_t* kv_offset,
                  out_t* out) {
  const int64_t n = last - first, first_block = first / block_size;
  const int64_t num_blocks = (n + block_size - 1) / block_size;
  for (int64_t h = 0; h < num_heads; ++h) {
    float a[HD] = {};
    const float* w = scores + h * n;
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const scalar_t* block = v_cache + block_table[first_block + blk] * block_size * row_size + kv_offset[h];
      const int64_t at = blk * block_size, count = std::min(block_size, n - at);
      for (int64_t o = 0; o < count; ++o) {
        const float wp = w[at + o];
        const scalar_t* v = block + o * row_size;
#pragma omp simd
        for (int64_t d = 0; d < HD; ++d) a[d] += wp * to_float(v[d]);
      }
    }
    for (int64_t d = 0; d < HD; ++d) out[h * HD + d] = static_cast<out_t>(a[d]);
  }
}

// The same for any head_dim: the sums live in `acc` [num_heads, head_dim].
template <typename scalar_t, typename out_t>
void weighted_sum_any(const float* scores, const scalar_t* v_cache, const int64_t* block_table, int64_t first,
                      int64_t last, int64_t block_size, int64_t row_size, int64_t num_heads, int64_t head_dim,
                      const int64_t* kv_offset, float* acc, out_t* out) {
  const int64_t n = last - first;
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t p = first; p < last; ++p) {
    const scalar_t* row = v_cache + (block_table[p / block_size] * block_size + p % block_size) * row_size;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float w = scores[h * n + p - first];
      const scalar_t* v = row + kv_offset[h];
      float* a = acc + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * to_float(v[d]);
    }
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) out[i] = static_cast<out_t>(acc[i]);
}

template <typename scalar_t, typename out_t>
void weighted_sum_dispatch(const float* scores, const scalar_t* v_cache, const int64_t* block_table, int64_t first,
                           int64_t last, int64_t block_size, int64_t row_size, int64_t num_heads, int64_t head_dim,
                           const int64_t* kv_offset, float* acc, out_t* out) {
  switch (head_dim) {  // a compile-time head_dim keeps each head's sum in registers
    case 64:
      return weighted_sum<scalar_t, 64>(scores, v_cache, block_table, first, last, block_size, row_size, num_heads,
                                        kv_offset, out);
    case 128:
      return weighted_sum<scalar_t, 128>(scores, v_cache, block_table, first, last, block_size, row_size, num_heads,
                                         kv_offset, out);
    default:
      return weighted_sum_any(scores, v_cache, block_table, first, last, block_size, row_size, num_heads, head_dim,
                              kv_offset, acc, out);
  }
}

// One request's positions [first, last) (first: a block's start), all its query heads. With
// `out` (the whole context): the attention output, each head's float32 softmax normalised before
// the weighted sum of V. Without (one part of the context, flash-decoding's split; vLLM's CPU
// paged_attention_v2 partitions it the same way): for head h, m[h] = its largest scaled score,
// l[h] = sum_p exp(score_p - m[h]) and part[h][:] = sum_p exp(score_p - m[h]) * v_p, float32,
// for `merge_parts`.
template <typename scalar_t>
void decode_range(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_table,
                  int64_t first, int64_t last, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, float scale, float* qf, float* scores, float* acc, scalar_t* out, float* m,
                  float* l, float* part) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_size = num_kv_heads * head_dim;  // elements of one position's K or V row
  int64_t kv_offset[kMaxHeads];  // where query head h's KV head starts within a row
  for (int64_t h = 0; h < num_heads; ++h) kv_offset[h] = (h / group) * head_dim;
  for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  const int64_t n = last - first, first_block = first / block_size;
  const int64_t num_blocks = (n + block_size - 1) / block_size;
  // Pass 1: scores[h][p - first] = (q_h . k_p) * scale, k_p taken from head h's KV head.
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const scalar_t* block = k_cache + block_table[first_block + blk] * block_size * row_size;
    if (blk + 1 < num_blocks) {
      prefetch_block(k_cache + block_table[first_block + blk + 1] * block_size * row_size, block_size * row_size);
    }
    const int64_t at = blk * block_size, count = std::min(block_size, n - at);
    for (int64_t o = 0; o < count; ++o) {
      const scalar_t* row = block + o * row_size;
      for (int64_t h = 0; h < num_heads; ++h) {  // kv_offset[h]: no integer division in the loop
        scores[h * n + at + o] = dot(qf + h * head_dim, row + kv_offset[h], head_dim);
      }
    }
  }
  // Softmax per query head, in float32 (a part keeps its numerators, its max and their sum).
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * n;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n; ++p) max_score = std::max(max_score, s[p]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < n; ++p) {
      s[p] = softmax_exp(s[p] - max_score);
      sum += s[p];
    }
    if (out == nullptr) {
      m[h] = max_score;
      l[h] = sum;
      continue;
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < n; ++p) s[p] *= inv;
  }
  // Pass 2: out_h (or part_h) = sum_p w[h][p] * v_p.
  if (out != nullptr) {
    weighted_sum_dispatch(scores, v_cache, block_table, first, last, block_size, row_size, num_heads, head_dim,
                          kv_offset, acc, out);
  } else {
    weighted_sum_dispatch(scores, v_cache, block_table, first, last, block_size, row_size, num_heads, head_dim,
                          kv_offset, acc, part);
  }
}

// One request's output from its parts' states (`decode_range` without `out`), in part order:
// out_h = sum_i exp(m_i - M) part_i / sum_i exp(m_i - M) l_i, M the largest m_i. sum: scratch
// [head_dim].
template <typename scalar_t>
void merge_parts(const float* m, const float* l, const float* part, int64_t num_parts, int64_t num_heads,
                 int64_t head_dim, float* sum, scalar_t* out) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < num_parts; ++i) top = std::max(top, m[i * num_heads + h]);
    std::fill(sum, sum + head_dim, 0.f);
    float denom = 0.f;
    for (int64_t i = 0; i < num_parts; ++i) {
      const float w = softmax_exp(m[i * num_heads + h] - top);
      denom += w * l[i * num_heads + h];
      const float* a = part + (i * num_heads + h) * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) sum[d] += w * a[d];
    }
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = static_cast<scalar_t>(sum[d] * inv);
  }
}

// Fewer requests than threads: each context is cut into parts of at least kMinPart positions
// (whole blocks), so that a batch of one 2,048-token request keeps every thread busy (193 ->
// 118 us a layer on 2 threads, default model, AMX Xeon, bfloat16). With a request a thread or
// more, whole contexts: splitting them measured slower (merging costs more than it balances).
constexpr int64_t kMinPart = 256;

inline int64_t part_length(int64_t total_len, int64_t block_size, int64_t threads) {
  const int64_t want = std::max(kMinPart, (total_len + 2 * threads - 1) / (2 * threads));
  return (want + block_size - 1) / block_size * block_size;
}

template <typename scalar_t>
void decode_all(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                const torch::Tensor& context_lens, double scale) {
  const int64_t num_decodes = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1), threads = omp_get_max_threads();
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  // A plain OpenMP loop rather than at::parallel_for: it runs on the calling thread's OpenMP
  // thread count, while at::parallel_for's first call on a thread (this library keeps its own
  // per-thread flag) resets that count to torch's process-wide default
  // (services/engine/threads.py sets the engine thread's count alone).
  if (num_decodes >= threads) {
#pragma omp parallel if (num_decodes > 1)
    {
      std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < num_decodes; ++b) {
        scores.resize(num_heads * lens[b]);
        const int64_t offset = b * num_heads * head_dim;
        decode_range<scalar_t>(q_ptr + offset, k_ptr, v_ptr, tables + b * max_blocks, 0, lens[b], block_size,
                               num_heads, num_kv_heads, head_dim, fscale, qf.data(), scores.data(), acc.data(),
                               out_ptr + offset, nullptr, nullptr, nullptr);
      }
    }
    return;
  }
  // The parts: (request, first position) items, a request's adjacent.
  int64_t total_len = 0;
  for (int64_t b = 0; b < num_decodes; ++b) total_len += lens[b];
  const int64_t part = part_length(total_len, block_size, threads);
  std::vector<int64_t> first_part(num_decodes + 1, 0), item_request, item_first;
  for (int64_t b = 0; b < num_decodes; ++b) {
    for (int64_t p = 0; p < lens[b]; p += part) item_request.push_back(b), item_first.push_back(p);
    first_part[b + 1] = static_cast<int64_t>(item_request.size());
  }
  const int64_t num_items = static_cast<int64_t>(item_request.size());
  std::vector<float> m(num_items * num_heads), l(num_items * num_heads), parts(num_items * num_heads * head_dim);
#pragma omp parallel if (num_items > 1)
  {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores(num_heads * part);
#pragma omp for schedule(dynamic, 1)  // parts differ in length: each thread takes the next
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t b = item_request[i], first = item_first[i], offset = b * num_heads * head_dim;
      decode_range<scalar_t>(q_ptr + offset, k_ptr, v_ptr, tables + b * max_blocks, first,
                             std::min(first + part, lens[b]), block_size, num_heads, num_kv_heads, head_dim, fscale,
                             qf.data(), scores.data(), acc.data(), nullptr, m.data() + i * num_heads,
                             l.data() + i * num_heads, parts.data() + i * num_heads * head_dim);
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_decodes; ++b) {
      const int64_t i = first_part[b];
      merge_parts(m.data() + i * num_heads, l.data() + i * num_heads, parts.data() + i * num_heads * head_dim,
                  first_part[b + 1] - i, num_heads, head_dim, qf.data(), out_ptr + b * num_heads * head_dim);
    }
  }
}

}  // namespace

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
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && out.sizes() == q.sizes(),
              "paged_decode_attention: expected q, out [num_decodes, num_heads, head_dim] and k_cache, v_cache "
              "[num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
              q.scalar_type() == out.scalar_type(), "paged_decode_attention: q, out and the caches differ in dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "paged_decode_attention: head_dim of q and the cache differ");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "paged_decode_attention: one block table and one context length per request");
  // Bounds: every position read must come from a block of this cache (no out-of-range reads).
  // Plain loops over a few hundred ids: negligible next to the attention itself.
  const int64_t* table_ids = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i) {
    TORCH_CHECK(table_ids[i] >= 0 && table_ids[i] < k_cache.size(0),
                "paged_decode_attention: block id ", table_ids[i], " outside [0, ", k_cache.size(0), ")");
  }
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < context_lens.numel(); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_tables.size(1) * k_cache.size(1),
                "paged_decode_attention: context length ", lens[b], " outside [1, max_blocks * block_size]");
  }
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(1) <= kMaxHeads, "paged_decode_attention: at most ", kMaxHeads, " heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_all<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
  });
}

