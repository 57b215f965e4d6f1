"""Compile time of a causal LM's graphs, whole against one compile per distinct layer.

For the default model (SmolLM2-135M-Instruct, 30 decoder layers) or `--model`, on `neuron`: a
prefill of `--prompt` tokens and one decode step over a static cache of `--cache` slots, compiled
cold (an empty compile cache, Dynamo reset) three ways in one run:
- whole: `torch.compile(model, backend="neuron")`, every layer inline in each graph (the baseline);
- regions: the repeated layers traced as nested compile regions and `regions.backend`, each
  distinct layer compiled once per shape, the rest of the graph in pieces (the library);
- one layer: the layer graphs alone, as `regions` compiled them (the floor: what a compile per
  shape cannot go below while it compiles a layer).
It prints graphs compiled, backend compile seconds and wall seconds (Dynamo tracing included),
the logits' largest difference from Transformers on the CPU, and the ratios.

    python benchmarks/layer_reuse.py [--model PATH] [--prompt 16] [--cache 256]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, StaticCache

import optimum_neuron_torch
from optimum_neuron_torch.compiler import cache_stats, regions, reset_cache_stats
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV


def prefill_and_decode(model, backend, prompt: int, slots: int) -> torch.Tensor:
    """The logits of the prefill and of one decode step (compiled with `backend`, if any), on the CPU."""
    ids = torch.randint(4, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=slots)
    # Allocated on the device before tracing: a cache allocated on first use copies its length from the
    # host inside the graph, which does not lower (TorchNeuron's backend would refuse the whole graph).
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch_size=1, num_heads=config.num_key_value_heads, head_dim=head_dim,
                               dtype=model.dtype, device=model.device)
    forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False) if backend else model
    logits = []
    with torch.no_grad():
        for step, position in ((ids, torch.arange(prompt)), (ids[:, -1:], torch.tensor([prompt]))):
            out = forward(input_ids=step.to(model.device), cache=cache, cache_position=position.to(model.device))
            logits.append(out.logits[:, -1].cpu())
    return torch.cat(logits)


def cold(run) -> tuple[float, object, object]:
    """`run()` with an empty compile cache and a reset Dynamo: its wall seconds, the cache stats and
    what it returned."""
    with tempfile.TemporaryDirectory() as folder:
        os.environ[COMPILE_CACHE_ENV] = folder
        torch._dynamo.reset()
        reset_cache_stats()
        start = time.perf_counter()
        result = run()
        return time.perf_counter() - start, cache_stats(), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--cache", type=int, default=256)
    args = parser.parse_args()
    path = args.model or optimum_neuron_torch.default_model_path()
    cpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to("neuron")
    layers = model.config.num_hidden_layers
    print(f"backend: {optimum_neuron_torch.backend_info()}; model: {path} ({layers} decoder layers); "
          f"prefill of {args.prompt} tokens and a decode step over {args.cache} cache slots, float32, cold, "
          f"{torch.get_num_threads()} threads")
    expected = prefill_and_decode(cpu, None, args.prompt, args.cache)

    whole_wall, whole, whole_logits = cold(lambda: prefill_and_decode(model, "neuron", args.prompt, args.cache))

    layer_seconds = []

    def timed_layers(gm, example_inputs):  # regions.backend, timing the layer graphs apart
        device_backend = torch._dynamo.lookup_backend("neuron")
        layer_graphs = [getattr(gm, call.args[0].target) for call in regions.region_calls(gm)]

        def compile_graph(graph, inputs):
            start = time.perf_counter()
            compiled = device_backend(graph, inputs)
            if any(graph is layer for layer in layer_graphs):
                layer_seconds.append(time.perf_counter() - start)
            return compiled

        return regions.compile_regions(gm, example_inputs, compile_graph)

    def with_regions():
        with regions.repeated_layers_as_regions(model):
            return prefill_and_decode(model, timed_layers, args.prompt, args.cache)

    regions_wall, by_region, regions_logits = cold(with_regions)
    print(f"{'':10} {'graphs':>7} {'compile s':>10} {'wall s':>8} {'max |logit - cpu|':>18}")
    for name, wall, stats, logits in (("whole", whole_wall, whole, whole_logits),
                                      ("regions", regions_wall, by_region, regions_logits)):
        difference = (logits - expected).abs().max().item()
        print(f"{name:10} {stats.misses:7d} {stats.compile_seconds:10.1f} {wall:8.1f} {difference:18.2e}")
    print(f"{'one layer':10} {len(layer_seconds):7d} {sum(layer_seconds):10.1f}")
    print(f"whole / regions: compile {whole.compile_seconds / by_region.compile_seconds:.1f}x, "
          f"wall {whole_wall / regions_wall:.1f}x; regions / one layer: compile "
          f"{by_region.compile_seconds / sum(layer_seconds):.1f}x")


if __name__ == "__main__":
    main()
