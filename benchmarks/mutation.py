"""Mutation testing of the modules where a silent bug costs users most, with mutmut.

    pip install -e ".[dev,mutation]"
    python benchmarks/mutation.py            # the whole campaign (14-45 minutes on 2 cores, see MUTATION.md)
    python benchmarks/mutation.py --report   # the table of the last campaign, without running it

mutmut copies `optimum_neuron_torch` into `mutants/` (git-ignored), mutates only the modules listed
in `[tool.mutmut] only_mutate` of pyproject.toml, runs the fast in-process tests of
`pytest_add_cli_args_test_selection` once to learn which tests reach which function, then runs, for
each mutant, only those tests (fastest first, stopping at the first failure). Tests that spawn a
Python subprocess are left out: the subprocess would import the unmutated package.

The table gives per module: mutants, killed (a test failed or the mutant timed out), survived, the
survivors judged equivalent (listed below with their reason) and the score killed / non-equivalent.
The exit status is 1 when a module scores below 95% or a survivor is neither killed nor judged
equivalent. Results: benchmarks/MUTATION.md. This is not part of `python -m pytest`.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_SCORE = 0.95
MODULES = [
    "optimum_neuron_torch.loading.safetensors_file",
    "optimum_neuron_torch.compiler.cache",
    "optimum_neuron_torch.generation.buckets",
    "optimum_neuron_torch.generation.padding",
    "optimum_neuron_torch.loading.loader",
    "optimum_neuron_torch.fallbacks.policy",
    "optimum_neuron_torch.serving.protocol",
    "optimum_neuron_torch.serving.app",
    "optimum_neuron_torch.serving.server",
    "optimum_neuron_torch.device.reference.distributed",
    "optimum_neuron_torch.loading.sharding",
    "optimum_neuron_torch.training.collator",
    "optimum_neuron_torch.training.trainer_integration",
    "optimum_neuron_torch.training.activation_checkpointing",
]
KILLED = {"killed", "timeout", "segfault"}
# A mutant can make a test allocate without bound (one reached 10 GB on a 24 GB machine): each test
# process gets this much address space, and a mutant that needs more fails its test (killed).
MEMORY_LIMIT_BYTES = 6 * 1024**3

# Survivors that no test can kill because the mutated program behaves the same: name -> reason.
EQUIVALENT: dict[str, str] = {
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁdefault__mutmut_23":
        "`max_length // 2` -> `max_length / 2` in the first bucket: only taken when below 16, and "
        "Buckets.__post_init__ applies int(), which truncates 10.5 to 10 like // does",
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁdefault__mutmut_30":
        "`<= max_length // 2` -> `<= max_length / 2` in the loop: the left side is an integer, and "
        "for an integer n, n <= m / 2 holds exactly when n <= m // 2",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁprefetch__mutmut_1":
        "`if self._map is not None` -> `is None` makes prefetch() a no-op (a file that opens always "
        "has a map): MADV_WILLNEED only starts kernel readahead, nothing a test can observe but speed",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁget_or_build__mutmut_27":
        "`uuid4().hex[:8]` -> `[:9]` in the private staging folder's name: still unique, never seen",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁadd__mutmut_13":
        "`'key'` -> `'XXkeyXX'` in the names `add` drops from the copied metadata: a kept 'key' is "
        "the entry's own key, so {'key': key, **copied} is the same dict",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁadd__mutmut_14":
        "`'key'` -> `'KEY'`: same as add__mutmut_13",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_1":
        "`self._mode = ''` -> `None`: the initial mode only has to differ from 'error' (set() then clears "
        "TorchNeuron's tracking on entering it); None differs too",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_2":
        "`self._mode = ''` -> `'XXXX'`: same as __init____mutmut_1",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_4":
        "`self._reported = set()` -> `None`: set() assigns it whenever it creates the observer, the only reader",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_12":
        "default `'warn'` -> `'WARN'`, which `.lower()` turns back into 'warn'",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ_warn_new_fallbacks__mutmut_12":
        "`stacklevel=2` dropped: only the source line the warning is attributed to changes, and with either "
        "value it is a line of the library's module hooks (the text names the op and the module); no value "
        "can point at user code, whose depth under the hooks varies",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ_warn_new_fallbacks__mutmut_13":
        "`stacklevel=2` -> `3`: same as _warn_new_fallbacks__mutmut_12",
    "optimum_neuron_torch.fallbacks.policy.x__name_caller__mutmut_20":
        "`*error.args[1:]` -> `[2:]`: the refused-fallback error comes from the C++ dispatcher with one "
        "argument, so both slices are empty",
    "optimum_neuron_torch.generation.padding.x_pad_token_id__mutmut_6":
        "`0 <= pad` -> `1 <= pad`: differs only for pad == 0, where the else branch returns the same 0",
    "optimum_neuron_torch.generation.padding.x_pad_token_id__mutmut_7":
        "`0 <= pad` -> `0 < pad`: same as x_pad_token_id__mutmut_6",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_9":
        "the id padding made on the CPU instead of the ids' device: equal results here because the reference "
        "device's torch.cat accepts a CPU operand (compiled generation pads on the host anyway); TorchNeuron "
        "would refuse the mix, a leniency of the reference device recorded in MUTATION.md",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_13":
        "same as x_pad_prompt__mutmut_9 (device argument dropped)",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_17":
        "same as x_pad_prompt__mutmut_9, for the mask padding",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_20":
        "same as x_pad_prompt__mutmut_17 (device argument dropped)",
    "optimum_neuron_torch.loading.loader.x_plan_loading__mutmut_5":
        "tensors of a file planned in name order instead of byte order: only the order of reads changes "
        "(sequential reads are faster), every tensor is read either way",
    "optimum_neuron_torch.loading.loader.x_plan_loading__mutmut_7":
        "same as x_plan_loading__mutmut_5 (no sort key)",
    "optimum_neuron_torch.loading.loader.x__tied_targets__mutmut_5":
        "getattr default `{}` -> `None`: `None or {}` is the same empty set",
    "optimum_neuron_torch.loading.loader.x_check_device_memory__mutmut_4":
        "`mem_get_info(device)` -> `mem_get_info(None)` (the current device): the same device in every test "
        "process, which has one device, and from_pretrained resolves `neuron` to the current device before "
        "the check",
    "optimum_neuron_torch.loading.loader.x_release__mutmut_4":
        "`!= 'meta'` -> `!= 'XXmetaXX'`: a tensor already on meta is replaced by another empty meta tensor, "
        "the same thing",
    "optimum_neuron_torch.loading.loader.x_release__mutmut_5":
        "`!= 'meta'` -> `!= 'META'`: same as x_release__mutmut_4",
    "optimum_neuron_torch.loading.loader.x_release__mutmut_6":
        "released tensors set to None instead of meta tensors: release() runs only on a failed load whose "
        "model is then dropped; the device memory is given back either way (tested)",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_2":
        "the progress bar's total left out: display only (the bar itself is tested through _progress)",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_3":
        "the progress bar's name left out: display only",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_7":
        "`previous_file = None` -> `''`: differs from every file object alike",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_8":
        "prefetch() skipped on a file change (called for the other tensors instead): prefetch only starts "
        "kernel readahead, speed only",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_9":
        "prefetch() called for every tensor: readahead again, speed only",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_10":
        "`value = None` -> `''`: a placeholder overwritten before use; neither holds device memory",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_11":
        "`source = None` -> `''`: same as x_stream_into__mutmut_10",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_28":
        "`value = source = None` -> `''` after the copy: both drop the references, which is the point",
    "optimum_neuron_torch.loading.loader.x_finalize__mutmut_6":
        "`conversion_errors={}` -> `None`: Transformers' finalization reads it only when non-empty",
    "optimum_neuron_torch.loading.loader.x_finalize__mutmut_7":
        "`skipped_pp_keys=set()` -> `None`: read only for pipeline-parallel loading, which the library does not do",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁ__init____mutmut_20":
        "`if size` -> `if size or True`: the header check before it refuses files under 8 bytes, so size is "
        "never 0 there",
}


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def mutmut(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).with_name("mutmut")
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "mutmut"]
    return subprocess.run([*command, *args], cwd=ROOT, check=not capture, text=True,
                          capture_output=capture, preexec_fn=None if capture else limit_memory)


def results() -> dict[str, str]:
    """{mutant name: status} of every mutant of the last campaign."""
    output = mutmut("results", "--all", "true", capture=True)
    if output.returncode:
        sys.exit(f"mutmut results failed:\n{output.stderr}")
    statuses = {}
    for line in output.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            statuses[name] = status.strip()
    return statuses


def module_of(mutant: str) -> str:
    return next((module for module in MODULES if mutant.startswith(module + ".")), mutant.rsplit(".", 1)[0])


def report(statuses: dict[str, str]) -> bool:
    by_module: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for name, status in statuses.items():
        by_module[module_of(name)].append((name, status))
    ok = True
    print(f"{'module':<50} {'total':>6} {'killed':>7} {'survived':>9} {'equivalent':>11} {'score':>7}")
    for module in MODULES:
        mutants = by_module.get(module, [])
        killed = sum(status in KILLED for _, status in mutants)
        survivors = [name for name, status in mutants if status not in KILLED]
        equivalent = [name for name in survivors if name in EQUIVALENT]
        relevant = len(mutants) - len(equivalent)
        score = killed / relevant if relevant else 1.0
        ok &= score >= TARGET_SCORE and len(survivors) == len(equivalent) and bool(mutants)
        print(f"{module:<50} {len(mutants):>6} {killed:>7} {len(survivors):>9} {len(equivalent):>11} {score:>7.1%}")
    unexplained = [(name, status) for name, status in statuses.items()
                   if status not in KILLED and name not in EQUIVALENT]
    if unexplained:
        print("\nSurvivors neither killed nor judged equivalent (`mutmut show NAME` shows the diff):")
        for name, status in unexplained:
            print(f"  {name}: {status}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the last campaign's table only")
    parser.add_argument("--keep", action="store_true", help="keep mutants/ and mutmut's cached results")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    args = parser.parse_args()
    os.chdir(ROOT)
    if not args.report:
        if not args.keep:
            shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        start = time.monotonic()
        mutmut("run", "--max-children", str(args.max_children))
        print(f"\nmutmut run took {time.monotonic() - start:.0f} s")
    sys.exit(0 if report(results()) else 1)


if __name__ == "__main__":
    main()
