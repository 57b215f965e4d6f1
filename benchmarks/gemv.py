#!/usr/bin/env python
"""What bounds batch-1 decode on the CPU: matrix-vector products against the read bandwidth.

A decode step of a few sequences multiplies one activation row by every weight matrix: it should read
the weights at the memory's speed. For each weight shape of SmolLM2-135M (the library's default
model) this measures, on a pool of ~200 MB of distinct matrices (so that no product is served from
the CPU's caches), in GB/s of weights read:
- `sum()` of each matrix: the read speed of the same bytes (the limit);
- `x @ W.t()` with W stored [out, in], as `F.linear` and the compiled graph run it (BLAS);
- `x @ W_t` with the weights stored [in, out];
- `x @ W.t()` on the `neuron` device: on the reference device, its decode-product kernel (one pass
  over each weight row; `csrc/matmul.cpp`), the kernel the compiled decode graphs call.

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
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated weight dtypes")
    parser.add_argument("--rows", type=int, default=1, help="activation rows (the decode batch)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import optimum_neuron_torch  # noqa: F401  (the `neuron` device)

    print(f"threads: {args.threads}; torch {torch.__version__}; {args.rows} activation row(s); GB/s of weights read")
    print("| dtype | layer | shape [out, in] | sum() | x @ W.t() ([out, in]) | x @ W_t ([in, out]) "
          "| `neuron` x @ W.t() | [out, in] / sum | neuron / sum |")
    print("|---|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
        for name, (rows, width) in SHAPES.items():
            count = max(2, POOL_BYTES // (rows * width * dtype.itemsize))
            pool = [torch.randn(rows, width, generator=generator, dtype=dtype) for _ in range(count)]
            pool_t = [matrix.t().contiguous() for matrix in pool]
            device_pool = [matrix.to("neuron") for matrix in pool]
            x = torch.randn(args.rows, width, generator=generator, dtype=dtype)
            x_device = x.to("neuron")
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close((x_device @ device_pool[0].t()).cpu(), x @ pool[0].t(),
                                       rtol=tolerance, atol=tolerance)
            read = speed(torch.sum, pool)
            blas = speed(lambda matrix, x=x: x @ matrix.t(), pool)
            transposed = speed(lambda matrix, x=x: x @ matrix, pool_t)
            device = speed(lambda matrix, x=x_device: x @ matrix.t(), device_pool)
            print(f"| {str(dtype)[6:]} | {name} | {rows} x {width} | {read:.1f} | {blas:.1f} | {transposed:.1f} "
                  f"| {device:.1f} | {blas / read:.2f} | {device / read:.2f} |")

if __name__ == "__main__":
    main()
