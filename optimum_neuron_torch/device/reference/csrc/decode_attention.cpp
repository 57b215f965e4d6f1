// Attention of a few query rows over a long key/value cache: the attention of a decode step.
//
// The CPU flash-attention kernel works in blocks of 32-64 query rows; for the one query row of a
// decode step it costs far more than reading the cache (SmolLM2's 9 heads over 2048 keys in
// bfloat16: 2.7 ms for 4.7 MB, 1.7 GB/s). This kernel reads each key and value row once for all the
// query rows that read its head: scores, a float32 softmax, the weighted sum of values. It follows the CPU kernel's
// conventions (scores scaled then masked, logsumexp = max + log(sum), fully masked rows are 0).
// Short caches keep the CPU kernel, so the tiny models of the tests keep its exact numerics.
#include "neuron.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <limits>
#include <vector>

namespace neuron {
namespace {

// Decode steps: a few tokens, or the query heads of a group packed as rows (up to 64: multi-query
// models' groups); longer queries are prefills, which the CPU kernel's blocks suit.
constexpr int64_t kMaxQueryRows = 64;
constexpr int64_t kKeyBlock = 32; // value rows read together for every query row (32 rows of 128 floats: 16 KB)
constexpr int64_t kMinKeys = 128; // below: the tests' tiny caches, and the CPU kernel is cheap there

#if defined(__x86_64__)

using simd::lane_sum;
using simd::load8;

// dot(q, k) over `size` values, q in float32.
template <typename T>
__attribute__((target("avx2,fma"))) float dot(const float* q, const T* k, int64_t size) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= size; d += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), odd);
  }
  float total = lane_sum(_mm256_add_ps(even, odd));
  for (; d < size; ++d) total += q[d] * static_cast<float>(k[d]);
  return total;
}

// dot(q, k_j) for the 8 rows k_j = k + j * k_stride, q in float32: 8 scores, reduced together.
template <typename T>
__attribute__((target("avx2,fma"))) __m256 dot8(const float* q, const T* k, int64_t k_stride, int64_t size) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < size; d += 8) {
    const __m256 query = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(query, load8(k + j * k_stride + d), acc[j]);
  }
  // Pairwise sums within 128-bit lanes, then the two halves of each row added: [sum(acc[0]), ..., sum(acc[7])].
  const __m256 low_high_0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 low_high_4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low_high_0123, low_high_4567, 0x20),
                       _mm256_permute2f128_ps(low_high_0123, low_high_4567, 0x31));
}

// acc += p * v over `size` values.
template <typename T>
__attribute__((target("avx2,fma"))) void add_scaled(float* acc, float p, const T* v, int64_t size) {
  const __m256 weight = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= size; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(weight, load8(v + d), _mm256_loadu_ps(acc + d)));
  }
  for (; d < size; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// acc += sum over s < keys of weights[s] * v_s (v_s = v + s * v_stride), head_dim values: the
// accumulator is held in registers, 64 values at a time, while the rows of v stream through.
template <typename T>
__attribute__((target("avx2,fma"))) void add_weighted(float* acc, const float* weights, const T* v, int64_t v_stride,
                                                      int64_t keys, int64_t head_dim) {
  int64_t d0 = 0;
  for (; d0 + 64 <= head_dim; d0 += 64) {
    __m256 sums[8];
    for (int j = 0; j < 8; ++j) sums[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
    for (int64_t s = 0; s < keys; ++s) {
      if (weights[s] == 0.0f) continue;
      const __m256 weight = _mm256_set1_ps(weights[s]);
      const T* row = v + s * v_stride + d0;
      for (int j = 0; j < 8; ++j) sums[j] = _mm256_fmadd_ps(weight, load8(row + 8 * j), sums[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, sums[j]);
  }
  if (d0 < head_dim) {
    for (int64_t s = 0; s < keys; ++s) {
      if (weights[s] != 0.0f) add_scaled(acc + d0, weights[s], v + s * v_stride + d0, head_dim - d0);
    }
  }
}

// scores[s] = exp(scores[s] - max) (0 if `all_masked`), eight at a time; returns their sum.
__attribute__((target("avx2,fma"))) float weigh(float* scores, int64_t keys, float max, bool all_masked) {
  if (all_masked) {
    std::fill(scores, scores + keys, 0.0f);
    return 0.0f;
  }
  const __m256 maximum = _mm256_set1_ps(max);
  __m256 total = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= keys; s += 8) {
    const __m256 weights = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), maximum));
    _mm256_storeu_ps(scores + s, weights);
    total = _mm256_add_ps(total, weights);
  }
  float sum = lane_sum(total);
  for (; s < keys; ++s) {
    scores[s] = std::exp(scores[s] - max);
    sum += scores[s];
  }
  return sum;
}

// One query row of `attend`: where its query, mask (`allowed`, a bool mask, or `bias`, an additive one,
// or neither), output and logsumexp are.
template <typename T>
struct QueryRow {
  const T* q;
  const bool* allowed;
  const T* bias;
  T* out;
  float* logsumexp;
};

// The query rows that read one key/value head (`k`, `v`): out = softmax(scale * q K^T + mask) V for
// each, and its logsumexp. The keys and values are read a block of positions at a time for all the rows
// (the query heads of a group, or a group's heads packed as query rows: reading the head once per row
// would multiply the step's memory traffic by the group). Each row's arithmetic is that of a row alone.
template <typename T>
__attribute__((target("avx2,fma"))) void attend(const std::vector<QueryRow<T>>& queries, int64_t q_stride_d,
            const T* k, int64_t k_stride_s, const T* v, int64_t v_stride_s, int64_t keys, int64_t head_dim, float scale, int64_t mask_stride_s,
            int64_t out_stride_d, std::vector<float>& scores, std::vector<float>& rows) {
  const int64_t count = static_cast<int64_t>(queries.size());
  rows.resize(count * head_dim);
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t d = 0; d < head_dim; ++d) rows[r * head_dim + d] = static_cast<float>(queries[r].q[d * q_stride_d]);
  }
  scores.resize(count * keys);
  // Eight keys at a time (when the head size is a multiple of 8), each block read once for every row.
  const int64_t blocked = head_dim % 8 == 0 ? keys - keys % 8 : 0;
  for (int64_t s = 0; s < blocked; s += 8) {
    for (int64_t r = 0; r < count; ++r) {
      _mm256_storeu_ps(scores.data() + r * keys + s,
                       _mm256_mul_ps(dot8(rows.data() + r * head_dim, k + s * k_stride_s, k_stride_s, head_dim),
                                     _mm256_set1_ps(scale)));
    }
  }
  for (int64_t s = blocked; s < keys; ++s) {
    for (int64_t r = 0; r < count; ++r) {
      scores[r * keys + s] = dot(rows.data() + r * head_dim, k + s * k_stride_s, head_dim) * scale;
    }
  }
  for (int64_t r = 0; r < count; ++r) {  // the masks
    const QueryRow<T>& query = queries[r];
    float* row_scores = scores.data() + r * keys;
    if (query.allowed != nullptr) {
      for (int64_t s = 0; s < keys; ++s) {
        if (!query.allowed[s * mask_stride_s]) row_scores[s] = -std::numeric_limits<float>::infinity();
      }
    } else if (query.bias != nullptr) {
      for (int64_t s = 0; s < keys; ++s) row_scores[s] += static_cast<float>(query.bias[s * mask_stride_s]);
    }
  }
  // Each row's weights exp(score - max), and their sum. As the CPU kernel: a fully masked row has max
  // 0 and sum 1, so its output is 0.
  std::vector<float> reciprocals(count);
  for (int64_t r = 0; r < count; ++r) {
    float* row_scores = scores.data() + r * keys;
    float max = -std::numeric_limits<float>::infinity();
    // (a NaN score, from a NaN key the row attends, makes the maximum NaN, so the row's output is NaN)
    for (int64_t s = 0; s < keys; ++s) max = row_scores[s] > max || std::isnan(row_scores[s]) ? row_scores[s] : max;
    const bool all_masked = max == -std::numeric_limits<float>::infinity();
    max = all_masked ? 0.0f : max;
    float sum = weigh(row_scores, keys, max, all_masked);
    sum = sum == 0.0f ? 1.0f : sum;
    reciprocals[r] = 1.0f / sum;
    *queries[r].logsumexp = max + std::log(sum);
  }
  std::fill(rows.begin(), rows.end(), 0.0f); // from here on, the output accumulators
  // A block of value rows (kKeyBlock x head_dim, in the L1 cache) at a time, for every row.
  for (int64_t s = 0; s < keys; s += kKeyBlock) {
    for (int64_t r = 0; r < count; ++r) {
      add_weighted(rows.data() + r * head_dim, scores.data() + r * keys + s, v + s * v_stride_s, v_stride_s,
                   std::min(kKeyBlock, keys - s), head_dim);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t d = 0; d < head_dim; ++d) {
      queries[r].out[d * out_stride_d] = static_cast<T>(rows[r * head_dim + d] * reciprocals[r]);
    }
  }
}

template <typename T>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                float scale, const at::Tensor& out, const at::Tensor& logsumexp) {
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), head_dim = query.size(3);
  const int64_t keys = key.size(2), kv_heads = key.size(1), group = heads / kv_heads;
  const T* q = static_cast<const T*>(query.const_data_ptr());
  const T* k = static_cast<const T*>(key.const_data_ptr());
  const T* v = static_cast<const T*>(value.const_data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  float* lse = logsumexp.data_ptr<float>();
  const bool bool_mask = mask.defined() && mask.scalar_type() == at::kBool;
  const bool* allowed = bool_mask ? mask.const_data_ptr<bool>() : nullptr;
  const T* bias = mask.defined() && !bool_mask ? static_cast<const T*>(mask.const_data_ptr()) : nullptr;
  // A work item per (batch row, key/value head): the `group * rows` query rows that read it.
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, accumulators;
    std::vector<QueryRow<T>> queries;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / kv_heads, kv_head = index % kv_heads;
      queries.clear();
      for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t mask_offset =
              mask.defined() ? b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2) : 0;
          queries.push_back({q + b * query.stride(0) + h * query.stride(1) + i * query.stride(2),
                             allowed == nullptr ? nullptr : allowed + mask_offset,
                             bias == nullptr ? nullptr : bias + mask_offset,
                             o + b * out.stride(0) + h * out.stride(1) + i * out.stride(2),
                             lse + (b * heads + h) * rows + i});
        }
      }
      attend(queries, query.stride(3), k + b * key.stride(0) + kv_head * key.stride(1), key.stride(2),
             v + b * value.stride(0) + kv_head * value.stride(1), value.stride(2), keys, head_dim, scale,
             mask.defined() ? mask.stride(3) : 0, out.stride(3), scores, accumulators);
    }
  });
}

#endif

} // namespace

bool is_decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal) {
  const auto dtype = query.scalar_type();
  if (!simd::has_avx2_fma() || (dtype != at::kFloat && dtype != at::kBFloat16) || dropout_p != 0.0 || is_causal ||
      query.dim() != 4 || key.dim() != 4 || value.dim() != 4 || key.scalar_type() != dtype ||
      value.scalar_type() != dtype || query.size(2) > kMaxQueryRows || key.size(2) < kMinKeys) {
    return false;
  }
  const bool shapes = key.size(0) == query.size(0) && value.size(0) == query.size(0) &&
      key.size(2) == value.size(2) && key.size(1) == value.size(1) && query.size(1) % key.size(1) == 0 &&
      key.size(3) == query.size(3) && value.size(3) == query.size(3) && key.stride(3) == 1 && value.stride(3) == 1;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& mask = *attn_mask;
    return shapes && mask.dim() == 4 && (mask.scalar_type() == at::kBool || mask.scalar_type() == dtype) &&
        !mask.is_neg() && !mask.is_conj();
  }
  return shapes;
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                    std::optional<double> scale) {
#if defined(__x86_64__)
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2);
  // The meta function's layouts: the output laid out like the query, logsumexp [batch, heads, rows] float32.
  at::Tensor out = at::empty_like(query);
  at::Tensor logsumexp = at::empty({batch, heads, rows}, query.options().dtype(at::kFloat));
  at::Tensor mask;
  if (attn_mask.has_value() && attn_mask->defined()) {
    mask = host_view(*attn_mask).expand({batch, heads, rows, key.size(2)});
  }
  // As the CPU kernel: the default scale computed in double, then used as a float.
  const float softmax_scale =
      static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(3))));
  if (query.scalar_type() == at::kFloat) {
    attend_all<float>(query, key, value, mask, softmax_scale, out, logsumexp);
  } else {
    attend_all<c10::BFloat16>(query, key, value, mask, softmax_scale, out, logsumexp);
  }
  return {out, logsumexp};
#else
  TORCH_CHECK(false, "neuron: the decode attention kernel needs an x86-64 CPU");
#endif
}

} // namespace neuron
