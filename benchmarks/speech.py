#!/usr/bin/env python
"""Speech recognition's real-time factor: Whisper's generate() on `neuron` (compiled, see
`optimum_neuron_torch.generation.speech_graphs`) against Transformers' eager generate() on the CPU, in one run.

The model has whisper-tiny's dimensions (384 wide, 4 encoder and 4 decoder layers, 51865 tokens, 80 mel
bins, 30-second windows) with random weights: no Whisper checkpoint ships in a PyPI package, and the
time of a step does not depend on the weights' values. Each call transcribes a 30-second window (one
encoder pass of 1500 positions), greedy, with exactly `--tokens` new tokens (min = max: a random model
would stop at any time), at batch 1 and 4. Printed per batch size: seconds per call (best of `--repeats`),
the real-time factor (seconds of compute per second of audio: lower is better), the speed-up over the
CPU, graphs compiled after warm-up (0 expected), and whether the tokens equal the CPU's.

The limit, in the same run: the encoder's floating-point operations (counted by torch's FlopCounterMode)
at this machine's matmul rate, plus each decode step's bytes (the decoder's weights, its embedding read
as the output projection, and the cross-attention keys and values of 1500 positions) at its read
bandwidth; the library's time over that bound is printed.

Usage:
    python benchmarks/speech.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import transformers
from serve import best_seconds, read_bandwidth
from torch.utils.flop_counter import FlopCounterMode

import optimum_neuron_torch  # noqa: F401  (the neuron device)
from optimum_neuron_torch.generation import Buckets, enable_compiled_generation

TINY = dict(vocab_size=51865, d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
            decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80,
            max_source_positions=1500, max_target_positions=448)
SECONDS = 30.0  # (one window)


def matmul_rate() -> float:
    """Floating-point operations per second of this machine's float32 matmul (the encoder's shapes)."""
    x, w = torch.randn(1500, 384), torch.randn(1536, 384)
    seconds = best_seconds(lambda: [x @ w.t() for _ in range(20)], 5)
    return 20 * 2 * 1500 * 384 * 1536 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    cpu = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**TINY)).eval()
    batches = (1, 4)
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), Buckets(batches, (16,), 448))
    began = time.perf_counter()
    model.precompile(show_progress=False)
    compile_seconds = time.perf_counter() - began
    settings = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    results = {"threads": torch.get_num_threads(), "compile_s": round(compile_seconds, 1), "batches": {}}
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        cpu.get_encoder()(torch.randn(1, 80, 3000))
    encoder_flops = flops.get_total_flops()
    decoder = cpu.get_decoder()
    decoder_bytes = sum(p.numel() * p.element_size() for p in decoder.parameters())
    cross_bytes = 2 * TINY["decoder_layers"] * 1500 * TINY["d_model"] * 4
    rate, bandwidth = matmul_rate(), read_bandwidth()
    for batch in batches:
        features = torch.randn(batch, 80, 3000)
        expected = cpu.generate(features, **settings)
        cpu_s = best_seconds(lambda x=features: cpu.generate(x, **settings), args.repeats)
        on_device = features.to("neuron")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        same = model.generate(on_device, **settings).cpu().tolist() == expected.tolist()
        neuron_s = best_seconds(lambda x=on_device: model.generate(x, **settings), args.repeats)
        limit_s = batch * encoder_flops / rate + args.tokens * (decoder_bytes + batch * cross_bytes) / bandwidth
        results["batches"][batch] = {
            "cpu_s": round(cpu_s, 3), "neuron_s": round(neuron_s, 3), "limit_s": round(limit_s, 3),
            "rtf_cpu": round(cpu_s / (batch * SECONDS), 4), "rtf_neuron": round(neuron_s / (batch * SECONDS), 4),
            "speedup": round(cpu_s / neuron_s, 2), "neuron_over_limit": round(neuron_s / limit_s, 2),
            "graphs_after_warm_up": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
            "tokens_equal_cpu": same,
        }
    results["limit"] = {"encoder_gflop": round(encoder_flops / 1e9, 2), "matmul_gflops": round(rate / 1e9, 1),
                        "decode_step_mb": round(decoder_bytes / 1e6, 1), "read_gbps": round(bandwidth / 1e9, 1)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
