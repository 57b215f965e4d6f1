// Attention of a few query rows over a long key/value cache: the attention of a decode step.
//
// The CPU flash-attention kernel works in blocks of 32-64 query rows; for the one query row of a
// decode step it costs far more than reading the cache (SmolLM2's 9 heads over 2048 keys in
// bfloat16: 2.7 ms for 4.7 MB, 1.7 GB/s). This kernel reads each key and value row once per query
// row: scores, a float32 softmax, the weighted sum of values. It follows the CPU kernel's
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

constexpr int64_t kMaxQueryRows = 8; // decode steps of up to 8 tokens; longer queries are prefills
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

// One query row: out = softmax(scale * q K^T + mask) V, and its logsumexp. The row's mask, if any,
// is `allowed` (a bool mask) or `bias` (an additive one), `mask_stride_s` apart per key.
template <typename T>
void attend(const T* q, int64_t q_stride_d, const T* k, int64_t k_stride_s, const T* v, int64_t v_stride_s,
            int64_t keys, int64_t head_dim, float scale, const bool* allowed, const T* bias, int64_t mask_stride_s,
            T* out, int64_t out_stride_d, float* logsumexp, std::vector<float>& scores, std::vector<float>& row) {
  row.resize(head_dim);
  for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(q[d * q_stride_d]);
  scores.resize(keys);
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < keys; ++s) {
    float score = dot(row.data(), k + s * k_stride_s, head_dim) * scale;
    if (allowed != nullptr && !allowed[s * mask_stride_s]) {
      score = -std::numeric_limits<float>::infinity();
    } else if (bias != nullptr) {
      score += static_cast<float>(bias[s * mask_stride_s]);
    }
    scores[s] = score;
    max = std::max(max, score);
  }
  // As the CPU kernel: a fully masked row has max 0 and sum 1, so its output is 0.
  const bool all_masked = max == -std::numeric_limits<float>::infinity();
  max = all_masked ? 0.0f : max;
  float sum = 0.0f;
  std::fill(row.begin(), row.end(), 0.0f); // from here on, the output accumulator
  for (int64_t s = 0; s < keys; ++s) {
    const float p = all_masked ? 0.0f : std::exp(scores[s] - max);
    sum += p;
    if (p != 0.0f) add_scaled(row.data(), p, v + s * v_stride_s, head_dim);
  }
  sum = sum == 0.0f ? 1.0f : sum;
  const float reciprocal = 1.0f / sum;
  for (int64_t d = 0; d < head_dim; ++d) out[d * out_stride_d] = static_cast<T>(row[d] * reciprocal);
  *logsumexp = max + std::log(sum);
}

template <typename T>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                float scale, const at::Tensor& out, const at::Tensor& logsumexp) {
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), head_dim = query.size(3);
  const int64_t keys = key.size(2), group = heads / key.size(1);
  const T* q = static_cast<const T*>(query.const_data_ptr());
  const T* k = static_cast<const T*>(key.const_data_ptr());
  const T* v = static_cast<const T*>(value.const_data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  float* lse = logsumexp.data_ptr<float>();
  const bool bool_mask = mask.defined() && mask.scalar_type() == at::kBool;
  const bool* allowed = bool_mask ? mask.const_data_ptr<bool>() : nullptr;
  const T* bias = mask.defined() && !bool_mask ? static_cast<const T*>(mask.const_data_ptr()) : nullptr;
  at::parallel_for(0, batch * heads * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (heads * rows), h = index / rows % heads, i = index % rows;
      const int64_t kv_head = h / group;
      const int64_t mask_offset = mask.defined() ? b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2) : 0;
      attend(q + b * query.stride(0) + h * query.stride(1) + i * query.stride(2), query.stride(3),
             k + b * key.stride(0) + kv_head * key.stride(1), key.stride(2),
             v + b * value.stride(0) + kv_head * value.stride(1), value.stride(2), keys, head_dim, scale,
             allowed == nullptr ? nullptr : allowed + mask_offset, bias == nullptr ? nullptr : bias + mask_offset,
             mask.defined() ? mask.stride(3) : 0, o + b * out.stride(0) + h * out.stride(1) + i * out.stride(2),
             out.stride(3), lse + index, scores, row);
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
