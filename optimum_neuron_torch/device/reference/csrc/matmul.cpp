// Matrix products of a few rows against a large weight: the products of a decode step.
//
// A decode step multiplies a handful of activation rows (one per sequence) by every weight matrix,
// so it is bound by how fast the weights are read. `x @ W.t()` with W stored [out, in] (how
// `F.linear` and compiled graphs call `mm`) reads at about half the memory's speed through the CPU
// BLAS (benchmarks/gemv.py); a device's matmul engine reads weights at its memory's speed, and so
// does this kernel: one pass over each weight row, a dot product with every activation row.
//
// Every other product (many rows, other layouts or dtypes, small weights) takes the generic path
// (the CPU kernel through the boxed fallback), so the tiny models of the tests keep the CPU's exact
// numerics. Each output element is summed in the same order whatever the number of rows, so a
// sequence's result does not depend on the other sequences of its batch.
#include "neuron.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace neuron {
namespace {

constexpr int64_t kMaxRows = 8; // decode batches; larger ones are matrix-matrix products for BLAS
constexpr int64_t kRowBlock = 4; // activation rows sharing one read of a weight row
constexpr int64_t kMinWeightElements = 1 << 16; // below: the tiny models of tests, CPU numerics

#if defined(__x86_64__)

using simd::lane_sum;

// 16 consecutive weights as two vectors of 8 floats. float32: elements 0-7 and 8-15. bfloat16: one
// 32-byte load whose 32-bit lanes hold elements (2i, 2i+1); the even elements are the lanes shifted
// left by 16 bits, the odd ones the lanes with their low half cleared (two instructions for 16
// weights, where widening 8 at a time takes four). The activations are permuted to match
// (`pair_up_blocks`).
__attribute__((target("avx2,fma"))) inline void load16(const float* w, __m256& first, __m256& second) {
  first = _mm256_loadu_ps(w);
  second = _mm256_loadu_ps(w + 8);
}
__attribute__((target("avx2,fma"))) inline void load16(const c10::BFloat16* w, __m256& first, __m256& second) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  first = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  second = _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Reorders each full block of 16 activations of a row as (0, 2, ..., 14, 1, 3, ..., 15): the order
// `load16` gives bfloat16 weights in. The tail stays in place.
void pair_up_blocks(float* row, int64_t width) {
  float block[16];
  for (int64_t k = 0; k + 16 <= width; k += 16) {
    for (int i = 0; i < 8; ++i) {
      block[i] = row[k + 2 * i];
      block[8 + i] = row[k + 2 * i + 1];
    }
    std::copy(block, block + 16, row + k);
  }
}

// out[m] = dot(x[m], w) for R rows of x (float32, `width` each, `x_stride` apart, in `load16`'s
// order) and one weight row w. Two accumulators per row (16 weights a step), then the tail: the same
// order for every R.
template <int R, typename W>
__attribute__((target("avx2,fma"))) void dot_rows(const float* x, int64_t x_stride, const W* w, int64_t width,
                                                 float* out) {
  // (Unrolled so that the accumulators stay in registers.)
  __m256 even[R], odd[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    even[r] = _mm256_setzero_ps();
    odd[r] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= width; k += 16) {
    __m256 w0, w1;
    load16(w + k, w0, w1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      even[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * x_stride + k), even[r]);
      odd[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * x_stride + k + 8), odd[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float total = lane_sum(_mm256_add_ps(even[r], odd[r]));
    for (int64_t j = k; j < width; ++j) {
      total += static_cast<float>(w[j]) * x[r * x_stride + j];
    }
    out[r] = total;
  }
}

// y[m, n] = sum_k x[m, k] * weight[n, k] for weight rows [begin, end).
template <typename W>
void rows_times_weight(const float* x, int64_t rows, int64_t width, const W* weight, int64_t begin, int64_t end,
                       float* y, int64_t y_stride) {
  float block[kRowBlock];
  for (int64_t n = begin; n < end; ++n) {
    const W* w = weight + n * width;
    int64_t m = 0;
    for (; m + kRowBlock <= rows; m += kRowBlock) {
      dot_rows<kRowBlock>(x + m * width, width, w, width, block);
      for (int64_t r = 0; r < kRowBlock; ++r) y[(m + r) * y_stride + n] = block[r];
    }
    for (; m < rows; ++m) {
      dot_rows<1>(x + m * width, width, w, width, block);
      y[m * y_stride + n] = block[0];
    }
  }
}

#endif

// `self @ mat2` where mat2 is the transpose of a row-major [out, in] weight, self has a few
// contiguous rows, and the weight is large enough for its read to matter.
bool is_decode_product(const at::Tensor& self, const at::Tensor& mat2) {
  if (!simd::has_avx2_fma() || self.dim() != 2 || mat2.dim() != 2 || self.scalar_type() != mat2.scalar_type() ||
      (self.scalar_type() != at::kFloat && self.scalar_type() != at::kBFloat16)) {
    return false;
  }
  const int64_t rows = self.size(0), width = self.size(1), outputs = mat2.size(1);
  return rows >= 1 && rows <= kMaxRows && width == mat2.size(0) && width * outputs >= kMinWeightElements &&
      self.stride(1) == 1 && mat2.stride(0) == 1 && mat2.stride(1) == width && !self.is_conj() &&
      !self.is_neg() && !mat2.is_conj() && !mat2.is_neg();
}

// Writes self @ mat2 into `out` ([rows, outputs], row-major, the inputs' dtype).
void decode_product(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& out) {
#if defined(__x86_64__)
  const int64_t rows = self.size(0), width = self.size(1), outputs = mat2.size(1);
  // The activations as contiguous float32 rows (a few KB), in the order the weights are read in.
  const at::Tensor x = host_view(self).to(at::kFloat).clone(at::MemoryFormat::Contiguous);
  if (mat2.scalar_type() == at::kBFloat16) {
    for (int64_t m = 0; m < rows; ++m) pair_up_blocks(x.data_ptr<float>() + m * width, width);
  }
  const bool in_place = out.scalar_type() == at::kFloat;
  std::vector<float> scratch(in_place ? 0 : rows * outputs);
  float* y = in_place ? static_cast<float*>(out.data_ptr()) : scratch.data();
  const float* x_data = x.const_data_ptr<float>();
  // Chunks of at least ~64K weight elements per thread: smaller ones cost more to hand out.
  const int64_t grain = std::max<int64_t>(1, kMinWeightElements / width);
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
    if (mat2.scalar_type() == at::kFloat) {
      rows_times_weight(x_data, rows, width, static_cast<const float*>(mat2.const_data_ptr()), begin, end, y,
                        outputs);
    } else {
      rows_times_weight(x_data, rows, width, static_cast<const c10::BFloat16*>(mat2.const_data_ptr()), begin,
                        end, y, outputs);
    }
  });
  if (!in_place) {
    auto* dst = static_cast<c10::BFloat16*>(out.data_ptr());
    for (int64_t i = 0; i < rows * outputs; ++i) dst[i] = c10::BFloat16(scratch[i]); // round to nearest even
  }
#else
  TORCH_CHECK(false, "neuron: the decode product kernel needs an x86-64 CPU");
#endif
}

// aten::mm and aten::mm.out: decode products here, everything else through the generic path.
void mm_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const bool has_out = op.schema().arguments().size() == 3;
  const size_t first = stack->size() - (has_out ? 3 : 2);
  const at::Tensor self = (*stack)[first].toTensor();
  const at::Tensor mat2 = (*stack)[first + 1].toTensor();
  if (!is_decode_product(self, mat2) || mat2.device() != self.device()) {
    boxed_fallback(op, stack);
    return;
  }
  at::Tensor out;
  if (has_out) {
    out = (*stack)[first + 2].toTensor();
    const bool fits = out.device() == self.device() && out.scalar_type() == self.scalar_type() &&
        out.dim() == 2 && out.size(0) == self.size(0) && out.size(1) == mat2.size(1) && out.is_contiguous();
    if (!fits) { // resizing or casting `out`: the CPU kernel's rules apply
      boxed_fallback(op, stack);
      return;
    }
  }
  track_explicit(has_out ? "aten::mm.out" : "aten::mm");
  if (!has_out) {
    out = at::empty({self.size(0), mat2.size(1)}, self.options());
  }
  decode_product(self, mat2, out);
  torch::jit::drop(*stack, has_out ? 3 : 2);
  torch::jit::push(*stack, out);
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("mm", torch::CppFunction::makeFromBoxedFunction<&mm_boxed>());
  m.impl("mm.out", torch::CppFunction::makeFromBoxedFunction<&mm_boxed>());
}

} // namespace neuron
