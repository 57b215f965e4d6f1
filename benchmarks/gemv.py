#!/usr/bin/env python
"""What bounds batch-1 decode on the CPU: matrix-vector products against the read bandwidth.

A decode step of one sequence multiplies one activation row by every weight matrix: it should read
the weights at the memory's speed. For each weight shape of SmolLM2-135M (the library's default
model) this measures, on a pool of ~200 MB of distinct matrices (so that no product is served from
the CPU's caches), in GB/s of weights read:
- `sum()` of each matrix: the read speed of the same bytes (the limit);
- `x @ W.t()` with W stored [out, in], as `F.linear` and the compiled graph run it (BLAS);
- `x @ W_t` with the weights stored [in, out];
- a row-at-a-time AVX2 dot-product kernel (one contiguous stream, 4 accumulators), built here with
  `torch.utils.cpp_extension.load_inline` for this measurement only: what a kernel written for the
  shape reaches. (Needs a C++ compiler and an AVX2 CPU.)

Usage:
    python benchmarks/gemv.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # (out, in) of SmolLM2-135M's linear layers
    "q_proj, o_proj": (576, 576),
    "k_proj, v_proj": (192, 576),
    "gate_proj, up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
POOL_BYTES = 200_000_000
KERNEL = r"""
#include <torch/extension.h>
#include <immintrin.h>

torch::Tensor rows_dot(torch::Tensor x, torch::Tensor weight) {
  const int64_t rows = weight.size(0), width = weight.size(1);
  auto out = torch::empty({rows}, x.options());
  const float* v = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for (int64_t n = 0; n < rows; n++) {
    const float* row = w + n * width;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= width; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(v + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8), _mm256_loadu_ps(v + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 16), _mm256_loadu_ps(v + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 24), _mm256_loadu_ps(v + k + 24), a3);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float total = 0;
    for (float lane : lanes) total += lane;
    for (; k < width; k++) total += row[k] * v[k];
    y[n] = total;
  }
  return out;
}
"""


def speed(function, pool: list[torch.Tensor], repeats: int = 3) -> float:
    """GB/s of `function` over every matrix of `pool`, best of `repeats` passes."""
    function(pool[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for matrix in pool:
            function(matrix)
        best = min(best, time.perf_counter() - start)
    return sum(matrix.nbytes for matrix in pool) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torch.utils.cpp_extension import load_inline

    kernel = load_inline("gemv_measurement", cpp_sources=KERNEL, functions=["rows_dot"],
                         extra_cflags=["-O3", "-mavx2", "-mfma"])
    print(f"threads: {args.threads}; torch {torch.__version__}; float32; GB/s of weights read")
    print("| layer | shape [out, in] | sum() | x @ W.t() ([out, in]) | x @ W_t ([in, out]) | row-dot kernel "
          "| [out, in] / sum | kernel / sum |")
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name, (rows, width) in SHAPES.items():
        count = max(2, POOL_BYTES // (rows * width * 4))
        pool = [torch.randn(rows, width, generator=generator) for _ in range(count)]
        pool_t = [matrix.t().contiguous() for matrix in pool]
        x = torch.randn(1, width, generator=generator)
        torch.testing.assert_close(kernel.rows_dot(x[0], pool[0]), (x @ pool[0].t())[0], rtol=1e-4, atol=1e-4)
        read = speed(torch.sum, pool)
        blas = speed(lambda matrix, x=x: x @ matrix.t(), pool)
        transposed = speed(lambda matrix, x=x: x @ matrix, pool_t)
        own = speed(lambda matrix, x=x: kernel.rows_dot(x[0], matrix), pool)
        print(f"| {name} | {rows} x {width} | {read:.1f} | {blas:.1f} | {transposed:.1f} | {own:.1f} "
              f"| {blas / read:.2f} | {own / read:.2f} |")


if __name__ == "__main__":
    main()
