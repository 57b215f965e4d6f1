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
The exit status is 1 when a module scores below 85% or a survivor is neither killed nor judged
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
TARGET_SCORE = 0.85
MODULES = [
    "optimum_neuron_torch.loading.safetensors_file",
    "optimum_neuron_torch.compiler.cache",
    "optimum_neuron_torch.generation.buckets",
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
    unexplained = [(name, status) for name, status in statuses.items() if status not in KILLED and name not in EQUIVALENT]
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
