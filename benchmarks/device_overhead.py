#!/usr/bin/env python
"""Per-op overhead of the `neuron` device against the CPU, measured in one run.

Small ops (16x16 add, in-place add, 64x64 mm, view, sum + .item(), 16x16 randn) and a tiny
Llama forward (built from a config with a fixed seed, nothing downloaded) run on the CPU and on
`neuron`. Each case is timed in blocks of many back-to-back calls with `time.perf_counter_ns`;
CPU and neuron blocks are interleaved so that drift hits both alike, and the per-call time is
the median over the blocks (the minimum is printed as well). The overhead is neuron minus CPU.
Then the allocation and first write of 1 MiB to 1 GiB tensors: the device's caching allocator,
warm and cold, against the CPU's and the write speed of memory already touched.

Usage:
    python benchmarks/device_overhead.py [--threads 1] [--profile full|torchneuron]
        [--breakdown] [--kv-heads 2] [--attn sdpa|eager] [--blocks 15] [--block-ms 20] [--alloc-repeats 5] [--check]

The target is at most 2 us of overhead per small op with the `full` profile (every op native,
no fallback accounting). The environment is set before `optimum_neuron_torch` is imported:
OPTIMUM_NEURON_TORCH_PROFILE from --profile, OPTIMUM_NEURON_TORCH_FALLBACK=silent.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

TARGET_US = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--profile", choices=("full", "torchneuron"), default="full",
                        help="support profile of the reference device (default full)")
    parser.add_argument("--blocks", type=int, default=15, help="timing blocks per case and device (default 15)")
    parser.add_argument("--block-ms", type=float, default=20.0,
                        help="target duration of one timing block in ms; sets the calls per block (default 20)")
    parser.add_argument("--target-us", type=float, default=TARGET_US,
                        help=f"overhead target per small op in us (default {TARGET_US})")
    parser.add_argument("--kv-heads", type=int, default=2,
                        help="key/value heads of the tiny Llama (4 attention heads; default 2, i.e. GQA)")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                        help="attention implementation of the tiny Llama (default sdpa)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time variants that split the overhead: add with out=, empty 16x16")
    parser.add_argument("--alloc-repeats", type=int, default=5,
                        help="repeats per size of the allocation + first write cases (default 5)")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a small op misses the target")
    return parser.parse_args(argv)


ARGS: argparse.Namespace
torch = None  # imported by setup(), after the environment is set


def setup(argv: list[str] | None = None) -> None:
    """Parses the arguments, sets the device's environment, then imports torch and the device."""
    global ARGS, torch, backend_info, clear_op_tracking, fallback_ops
    ARGS = parse_args(argv)
    # Must happen before optimum_neuron_torch is imported: the device reads them at activation.
    os.environ["OPTIMUM_NEURON_TORCH_PROFILE"] = ARGS.profile
    os.environ["OPTIMUM_NEURON_TORCH_FALLBACK"] = "silent"
    import torch as torch_module

    import optimum_neuron_torch  # noqa: F401  (registers the `neuron` device)
    from optimum_neuron_torch.device import backend_info, clear_op_tracking, fallback_ops  # noqa: F811

    torch = torch_module


@dataclass
class Result:
    name: str
    small: bool
    calls_per_block: int
    cpu_ns: list[float]  # per-call ns, one entry per block
    neuron_ns: list[float]

    @property
    def cpu_us(self) -> float:
        return statistics.median(self.cpu_ns) / 1e3

    @property
    def neuron_us(self) -> float:
        return statistics.median(self.neuron_ns) / 1e3

    @property
    def overhead_us(self) -> float:
        return self.neuron_us - self.cpu_us

    @property
    def min_overhead_us(self) -> float:
        return (min(self.neuron_ns) - min(self.cpu_ns)) / 1e3

    @property
    def ratio(self) -> float:
        return self.neuron_us / self.cpu_us


def _block(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Per-call ns of `calls` back-to-back calls of `fn`."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter_ns() - start) / calls


def _calls_per_block(fn: Callable[[], object], block_ms: float) -> int:
    calls = 1
    while True:
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter_ns() - start
        if elapsed >= 2e6 or calls >= 1 << 20:  # at least 2 ms of calibration
            per_call = elapsed / calls
            return max(1, int(block_ms * 1e6 / per_call))
        calls *= 2


def measure(name: str, small: bool, cpu_fn: Callable[[], object], neuron_fn: Callable[[], object],
            blocks: int, block_ms: float) -> Result:
    no_sync = lambda: None  # noqa: E731
    neuron_sync = torch.neuron.synchronize  # a no-op on the synchronous reference device
    # Warm up both (first-call costs: op entry lookup, allocator, lazy init).
    for fn in (cpu_fn, neuron_fn):
        for _ in range(50):
            fn()
    calls = _calls_per_block(cpu_fn, block_ms)  # the same call count on both devices
    cpu_ns, neuron_ns = [], []
    gc.collect()
    gc.disable()
    try:
        for i in range(blocks):
            # Alternate which device goes first so that neither always follows the other.
            if i % 2 == 0:
                cpu_ns.append(_block(cpu_fn, calls, no_sync))
                neuron_ns.append(_block(neuron_fn, calls, neuron_sync))
            else:
                neuron_ns.append(_block(neuron_fn, calls, neuron_sync))
                cpu_ns.append(_block(cpu_fn, calls, no_sync))
    finally:
        gc.enable()
    return Result(name, small, calls, cpu_ns, neuron_ns)


def small_op_cases() -> list[tuple[str, bool, Callable[[], object], Callable[[], object]]]:
    torch.manual_seed(0)
    a16, b16 = torch.randn(16, 16), torch.randn(16, 16)
    a64, b64 = torch.randn(64, 64), torch.randn(64, 64)
    tensors = {}
    for dev in ("cpu", "neuron"):
        tensors[dev] = dict(
            a16=a16.to(dev), b16=b16.to(dev), a64=a64.to(dev), b64=b64.to(dev),
            acc=a16.clone().to(dev),  # target of the in-place add
            out=torch.empty(16, 16, device=dev),  # out= target (breakdown only)
        )

    # Correctness check before timing: the device computes what the CPU computes.
    c, n = tensors["cpu"], tensors["neuron"]
    assert torch.equal((n["a16"] + n["b16"]).cpu(), c["a16"] + c["b16"])
    assert torch.allclose(torch.mm(n["a64"], n["b64"]).cpu(), torch.mm(c["a64"], c["b64"]), atol=1e-5)
    assert n["a16"].sum().item() == c["a16"].sum().item()

    def cases_for(dev: str) -> dict[str, Callable[[], object]]:
        t = tensors[dev]
        a16, b16, a64, b64, acc = t["a16"], t["b16"], t["a64"], t["b64"], t["acc"]
        device = torch.device(dev)
        out = t["out"]
        cases = {
            "add 16x16": lambda: a16 + b16,
            "add_ 16x16 (in place)": lambda: acc.add_(b16),
            "mm 64x64": lambda: torch.mm(a64, b64),
            "view 16x16 -> 256": lambda: a16.view(256),
            "sum 16x16 + .item()": lambda: a16.sum().item(),
            "randn 16x16": lambda: torch.randn(16, 16, device=device),
        }
        if ARGS.breakdown:
            cases["(add 16x16 out=)"] = lambda: torch.add(a16, b16, out=out)
            cases["(empty 16x16)"] = lambda: torch.empty(16, 16, device=device)
        return cases

    cpu_cases, neuron_cases = cases_for("cpu"), cases_for("neuron")
    return [(name, not name.startswith("("), cpu_cases[name], neuron_cases[name]) for name in cpu_cases]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=ARGS.kv_heads, vocab_size=1000, max_position_embeddings=128,
        attn_implementation=ARGS.attn,
    )
    torch.manual_seed(0)
    cpu_model = LlamaForCausalLM(config).eval()
    torch.manual_seed(0)
    neuron_model = LlamaForCausalLM(config).eval().to("neuron")
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    cpu_ids, neuron_ids = ids, ids.to("neuron")

    def cpu_fn():
        return cpu_model(input_ids=cpu_ids, use_cache=False).logits

    def neuron_fn():
        return neuron_model(input_ids=neuron_ids, use_cache=False).logits

    with torch.no_grad():
        diff = (neuron_fn().cpu() - cpu_fn()).abs().max().item()
    return cpu_fn, neuron_fn, diff, config


ALLOCATION_SIZES = (1 << 20, 16 << 20, 256 << 20, 1 << 30)


def allocation_rates(size: int, repeats: int) -> dict[str, float]:
    """GB/s of allocating `size` bytes and writing them once (`torch.empty(...).fill_(1)`, then freed):
    on the CPU (PyTorch's CPU allocator: fresh memory from the host each time), on `neuron` with its
    cache warm (the freed block serves the next allocation) and cold (`empty_cache()` before each
    allocation: fresh host memory, first-touch page faults), and the physical limit: the same write
    into device memory already touched (a kept tensor)."""

    def rate(make: Callable[[], object], before: Callable[[], None] = lambda: None) -> float:
        times = []
        for _ in range(repeats):
            before()
            start = time.perf_counter()
            make()
            times.append(time.perf_counter() - start)
        return size / statistics.median(times) / 1e9

    kept = torch.empty(size, dtype=torch.uint8, device="neuron")
    kept.fill_(0)
    rates = {
        "cpu": rate(lambda: torch.empty(size, dtype=torch.uint8).fill_(1)),
        "neuron_warm": rate(lambda: torch.empty(size, dtype=torch.uint8, device="neuron").fill_(1)),
        "neuron_cold": rate(lambda: torch.empty(size, dtype=torch.uint8, device="neuron").fill_(1),
                            before=torch.neuron.empty_cache),
        "limit": rate(lambda: kept.fill_(1)),
    }
    torch.neuron.empty_cache()
    return rates


def count_aten_ops(fn: Callable[[], object]) -> int:
    """ATen ops that one call of `fn` dispatches below autograd (as the backend sees them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Counter():
        fn()
    return Counter.count


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def source_state() -> str:
    """The git commit of the checkout, whether the package sources differ from it, and the build."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "optimum_neuron_torch"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        state = f"git {head}" + (f" + uncommitted changes in {len(dirty)} package file(s)" if dirty else " (clean)")
    except (OSError, subprocess.CalledProcessError):
        state = "not a git checkout"
    try:
        from optimum_neuron_torch.device import reference

        state += f"; extension {reference.state().extension.__name__}"
    except Exception:  # TorchNeuron backend, or the reference device is not active
        pass
    return state


def main(argv: list[str] | None = None) -> int:
    setup(argv)
    torch.set_num_threads(ARGS.threads)
    info = backend_info()
    print("device_overhead: neuron vs CPU, per-call time")
    print(f"  backend      : {info}")
    print(f"  profile      : {ARGS.profile} "
          f"(OPTIMUM_NEURON_TORCH_PROFILE={os.environ['OPTIMUM_NEURON_TORCH_PROFILE']}, "
          f"fallback {os.environ['OPTIMUM_NEURON_TORCH_FALLBACK']})")
    print(f"  threads      : torch.get_num_threads() = {torch.get_num_threads()} (--threads {ARGS.threads})")
    print(f"  machine      : {os.cpu_count()} CPUs, {cpu_model_name()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"  source       : {source_state()}")
    load = os.getloadavg()[0]
    print(f"  load average : {load:.2f} over the last minute, on {os.cpu_count()} CPUs")
    if load > 0.5 * (os.cpu_count() or 1):
        # (other work on the cores inflates both columns and their difference: 1.2 us of "overhead" with
        # one busy loop beside the benchmark on a 2-CPU VM, 0.6 us quiet; see RESULTS.md, issue 38 item 7)
        print("  WARNING      : the machine is busy: the per-call times and the overhead are inflated; compare "
              "overheads from a quiet machine only")
    print(f"  timing       : {ARGS.blocks} interleaved blocks of ~{ARGS.block_ms:g} ms per case and device; "
          "median per-call time over blocks")
    sys.stdout.flush()

    results: list[Result] = []
    clear_op_tracking()
    with torch.no_grad():
        for name, small, cpu_fn, neuron_fn in small_op_cases():
            results.append(measure(name, small, cpu_fn, neuron_fn, ARGS.blocks, ARGS.block_ms))
    small_fallbacks = fallback_ops()

    with torch.no_grad():
        cpu_fn, neuron_fn, diff, config = tiny_llama()
        cpu_ops, neuron_ops = count_aten_ops(cpu_fn), count_aten_ops(neuron_fn)
        clear_op_tracking()
        neuron_fn()
        llama_fallbacks = fallback_ops()
        results.append(measure("tiny Llama forward", False, cpu_fn, neuron_fn, ARGS.blocks, ARGS.block_ms))

    target = f"<= {ARGS.target_us:g} us"
    width = max(8, len(target))
    header = f"| {'op':<22} | {'CPU us':>9} | {'neuron us':>9} | {'overhead us':>11} | {'ratio':>6} | " \
             f"{'min-based ovh us':>16} | {'calls/block':>11} | {target:>{width}} |"
    print()
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for r in results:
        verdict = ("yes" if r.overhead_us <= ARGS.target_us else "NO") if r.small else "-"
        print(f"| {r.name:<22} | {r.cpu_us:>9.2f} | {r.neuron_us:>9.2f} | {r.overhead_us:>11.2f} | "
              f"{r.ratio:>5.2f}x | {r.min_overhead_us:>16.2f} | {r.calls_per_block:>11} | {verdict:>{width}} |")

    llama = results[-1]
    print()
    print(f"tiny Llama: hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
          f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
          f"{config.num_key_value_heads} kv heads, "
          f"vocab {config.vocab_size}, input 1x16, eval, no_grad, use_cache=False, "
          f"attn {getattr(config, '_attn_implementation', None)}")
    print(f"  ATen ops per forward: {cpu_ops} on CPU, {neuron_ops} on neuron; overhead {llama.overhead_us:.1f} us "
          f"per forward = {llama.overhead_us / neuron_ops:.2f} us per neuron ATen op")
    print(f"  max |logits(neuron) - logits(CPU)| = {diff:.2e}")
    print(f"  fallback ops (small-op cases): {', '.join(small_fallbacks) or 'none'}")
    print(f"  fallback ops (one Llama forward): {', '.join(llama_fallbacks) or 'none'}")

    print()
    print("allocation + first write (torch.empty(n, dtype=uint8).fill_(1), then freed), GB/s, median of "
          f"{ARGS.alloc_repeats}; limit: the same write into device memory already touched")
    print("| size     | CPU   | neuron, cache warm | neuron, cold (empty_cache) | limit | warm/limit | cold/CPU |")
    print("|----------|-------|--------------------|----------------------------|-------|------------|----------|")
    for size in ALLOCATION_SIZES:
        r = allocation_rates(size, ARGS.alloc_repeats)
        print(f"| {size >> 20:>4} MiB | {r['cpu']:>5.1f} | {r['neuron_warm']:>18.1f} | {r['neuron_cold']:>26.1f} | "
              f"{r['limit']:>5.1f} | {r['neuron_warm'] / r['limit']:>9.2f}x | {r['neuron_cold'] / r['cpu']:>7.2f}x |")

    small = [r for r in results if r.small]
    missed = [r.name for r in small if r.overhead_us > ARGS.target_us]
    print()
    if missed:
        print(f"target (<= {ARGS.target_us:g} us overhead per small op, profile {ARGS.profile}): "
              f"MISSED by {', '.join(missed)}")
    else:
        print(f"target (<= {ARGS.target_us:g} us overhead per small op, profile {ARGS.profile}): "
              f"met by all {len(small)} small ops")
    if ARGS.profile != "full":
        print("  (the target is defined for the full profile; this run uses the fallback-counting profile)")
    return 1 if missed and ARGS.check else 0


if __name__ == "__main__":
    sys.exit(main())
