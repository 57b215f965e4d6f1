#!/usr/bin/env python
"""`generate()` with a logits processor the device does not apply (`no_repeat_ngram_size`): its
tokens chosen on the host on the generation engine, against the compiled-graph path they
took before (the static graphs of `static_graphs`), against the same call with processors the device applies, and
the physical limit, in one run.

The default model (SmolLM2-135M-Instruct, float32, vocabulary 49152), default buckets, greedy, a
32-token prompt, 64 new tokens (no end-of-sequence token), at batch 1 and 4. Per variant: decode
tokens/s per sequence, `63 / (time of a 64-token call - time of a 1-token call)`, best of `--rounds`
rounds, the variants alternating within each round (the CPU of a VM is noisy from one process to
the next); and the device-to-host bytes a decode step moves (the reference device's counts).
- `engine, on the device`: plain greedy search (the step's argmax, 8 bytes a row back);
- `engine, on the host`: with `no_repeat_ngram_size=3`: each step reads the rows' logits (4 x 49152
  bytes a row) and runs Transformers' processor on each row;
- `compiled graphs (before)`: the same call on the static graphs (`static_graphs`), where such calls ran
  until now (Transformers' loop on the host, its logits read each step).
With `--scores`, the host variants ask for the scores of each step instead (`return_dict_in_generate=True,
output_scores=True`), which the engine serves by choosing on the host (and the static graphs served before).
The limit: the bytes a decode step reads (the weights, the KV cache of the context bucket, and the
logits crossing to the host) at the read bandwidth measured in the same run (`x.sum()` of 1 GiB).

Usage:
    python benchmarks/host_processors.py [--threads 2] [--rounds 3] [--scores]
"""

from __future__ import annotations

import argparse
import time

import torch
from generate import bytes_per_step, default_buckets, read_bandwidth

PROMPT, NEW_TOKENS = 32, 64
ON_HOST = dict(no_repeat_ngram_size=3)
VARIANTS = ("engine, on the device", "engine, on the host", "compiled graphs (before)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--scores", action="store_true", help="the host variants return each step's scores")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from optimum_neuron_torch import NeuronAutoModelForCausalLM
    from optimum_neuron_torch.device import reference
    from optimum_neuron_torch.loading.default_model import default_model_path

    bandwidth = read_bandwidth(args.threads)
    folder = default_model_path()
    model = NeuronAutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generation = model.neuron_generation
    vocab = model.config.vocab_size
    batches = [int(batch) for batch in args.batches.split(",")]

    def run(variant: str, ids: torch.Tensor, new_tokens: int) -> float:
        settings = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        if variant != VARIANTS[0]:
            settings.update(dict(return_dict_in_generate=True, output_scores=True) if args.scores else ON_HOST)
        generation.engine_gap = "benchmark: the compiled graphs" if variant == VARIANTS[2] else None
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        return time.perf_counter() - start

    best: dict[tuple[str, int], float] = {}
    moved: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for batch in batches:
            ids = torch.randint(100, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
            for variant in VARIANTS:
                run(variant, ids, NEW_TOKENS)  # (compiles on first use; warms the caches)
                counts = []
                for new_tokens in (NEW_TOKENS // 2, NEW_TOKENS):
                    reference.clear_transfer_counts()
                    run(variant, ids, new_tokens)
                    counts.append(reference.transfer_counts()["device_to_host_bytes"])
                moved[(variant, batch)] = (counts[1] - counts[0]) / (NEW_TOKENS // 2)
                decode = run(variant, ids, NEW_TOKENS) - run(variant, ids, 1)
                best[(variant, batch)] = min(best.get((variant, batch), float("inf")), decode / (NEW_TOKENS - 1))
    generation.engine_gap = None

    buckets, context = default_buckets(folder)
    print(f"read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads); context bucket {context}; "
          f"{args.rounds} rounds; host variants: {'output_scores' if args.scores else 'no_repeat_ngram_size=3'}")
    print("| batch | variant | decode tokens/s per sequence | device-to-host bytes a step | vs on the device "
          "| limit (tokens/s) | of the limit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in batches:
        weights, cache = bytes_per_step(folder, "float32", batch, context)
        for variant in VARIANTS:
            seconds = best[(variant, batch)]
            logits = 4 * vocab * batch if variant != VARIANTS[0] else 0
            limit = bandwidth * 1e9 / (weights + cache + logits)
            print(f"| {batch} | {variant} | {1 / seconds:.1f} | {moved[(variant, batch)]:.0f} "
                  f"| {best[(VARIANTS[0], batch)] / seconds:.2f}x | {limit:.1f} | {1 / seconds / limit:.0%} |")


if __name__ == "__main__":
    main()
