"""Sweeps of model types: each type run by a script's `run_one` in a process of its own (a time and a
memory limit, one compile cache), and the generated table of their results (a JSON file and its
Markdown rendering). Used by `coverage.py` (causal LMs) and `coverage_multimodal.py` (speech and
vision-language models), which say what runs and how a row reads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

MEMORY_LIMIT = 10 * 2**30  # address space of each type's process: a type that would exhaust the host fails alone


class Table(NamedTuple):
    """A generated table: its JSON (`results`), its Markdown (`markdown`), how its counts are made
    from the rows (`summarize`) and how the JSON renders (`render`)."""

    results: Path
    markdown: Path
    summarize: Callable[[list[dict]], dict]
    render: Callable[[dict], str]


def lowering(cache_keys) -> str:
    """Whether the compiled graphs (or their pieces) lowered to StableHLO, which TorchNeuron's
    compiler needs: "ok", "fails" (they ran on the reference device only), or "unchecked"."""
    from optimum_neuron_torch.compiler import CompileCache
    from optimum_neuron_torch.compiler.artifact import LOWERS, lowering_failed

    statuses = [entry.metadata.get("stablehlo", "unchecked") for entry in map(CompileCache().get, cache_keys)
                if entry is not None and not entry.is_function]  # (a traced function's graphs are entries too)
    if any(lowering_failed(status) for status in statuses if status != "unchecked"):
        return "fails"
    return "ok" if statuses and all(status == LOWERS for status in statuses) else "unchecked"


class Stage:
    """Records the stage a type reached and the first line of the error that ended it (with the next
    when it ends in a colon, as Dynamo's "backend raised:" does)."""

    def __init__(self, result: dict) -> None:
        self.result = result

    def __call__(self, name: str):
        self.name, self.started = name, time.perf_counter()
        print(f"stage {name}", file=sys.stderr, flush=True)
        return self

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self.result.setdefault("stage_seconds", {})[self.name] = round(time.perf_counter() - self.started, 1)
        if error is None or "error" in self.result:
            return True  # (the first error is the one the row shows)
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].endswith(":"):  # (Dynamo's "backend='neuron' raised:" and the error)
            lines[0] = f"{lines[0]} {lines[1]}"
        message = f"{kind.__name__}: {lines[0] if lines else ''}".strip()
        self.result["error"] = {"stage": self.name, "message": message[:500]}  # (a split's reason comes last)
        return True


def randomize(model) -> None:
    """Noise on every floating weight (init leaves norms at 1 and biases at 0, which hides bugs)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def run_in_subprocess(model_type: str, timeout: float, cache_dir: Path, script: str) -> dict:
    """`script`'s `run_one` (`--one model_type`) in a fresh Python process, stopped after `timeout` seconds."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "OPTIMUM_NEURON_TORCH_COMPILE_CACHE": str(cache_dir), "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, script, "--one", model_type, "--folder", folder]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                                  preexec_fn=_limit_memory)
        except subprocess.TimeoutExpired as expired:
            stages = [line for line in (expired.stderr or b"").decode(errors="replace").splitlines()
                      if line.startswith("stage ")]
            stage = stages[-1].split()[1] if stages else "start"
            return {"type": model_type, "seconds": round(timeout),
                    "error": {"stage": stage, "message": f"did not finish in {timeout:.0f} s"}}
        seconds = round(time.perf_counter() - started, 1)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
            return {"type": model_type, "seconds": seconds,
                    "error": {"stage": "process", "message": f"exit {done.returncode}: {tail[0][:300]}"}}
        return {**json.loads(lines[-1]), "seconds": seconds}


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run(types: list[str], jobs: int, timeout: float, script: str, describe: Callable[[dict], str]) -> list[dict]:
    """Each type through `script`'s `run_one` in a process of its own, `jobs` at a time (one compile cache)."""
    with tempfile.TemporaryDirectory() as cache_dir, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_in_subprocess, model_type, timeout, Path(cache_dir), script): model_type
                   for model_type in types}
        results = []
        for future in concurrent.futures.as_completed(futures):
            results.append(future.result())
            print(f"[{len(results)}/{len(types)}] {describe(results[-1])}", flush=True)
    return sorted(results, key=lambda result: result["type"])


def write(results: list[dict], seconds: float, jobs: int, table: Table) -> None:
    """Writes the table's JSON (the results and how they were produced) and its rendering."""
    import torch
    import transformers

    data = {"summary": table.summarize(results), "transformers": transformers.__version__,
            "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(), "jobs": jobs,
            "minutes": round(seconds / 60), "results": results}
    _write(data, table)


def update(results: list[dict], table: Table) -> None:
    """Replaces the rows of these types in the table's JSON and its rendering (after a fix)."""
    data = json.loads(table.results.read_text())
    rows = {result["type"]: result for result in data["results"]} | {result["type"]: result for result in results}
    data["results"] = sorted(rows.values(), key=lambda result: result["type"])
    data["summary"] = table.summarize(data["results"])
    _write(data, table)


def _write(data: dict, table: Table) -> None:
    table.results.parent.mkdir(exist_ok=True)
    table.results.write_text(json.dumps(data, indent=1) + "\n")
    table.markdown.write_text(table.render(data))


def lowering_mark(result: dict) -> str:
    if not result.get("graphs"):
        return "–"
    if result.get("stablehlo") == "fails":
        return "no"
    return "split" if result.get("split_graphs") else {"ok": "yes"}.get(result.get("stablehlo"), "–")


def mark(value) -> str:
    return "yes" if value else "no" if value is not None else "–"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(script: str, doc: str, *, run_one: Callable[[str, Path], dict], all_types: Callable[[], list[str]],
         sample: tuple[str, ...], table: Table, describe: Callable[[dict], str], timeout: float) -> None:
    """The command line of a sweep script (see `coverage.py`'s docstring): one type in this process
    (`--one`, as `run_in_subprocess` calls it), or some, the sample or all, `run_one` each in a
    process of its own; all of them write `table`, `--update` replaces the rows of the types run."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", help="comma-separated types, as the table names them (default: all)")
    parser.add_argument("--sample", action="store_true", help="the fixed sample that CI runs")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--update", action="store_true",
                        help="with --types: replace these types' rows of the committed table")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, Path(args.folder))), flush=True)
        return
    types = args.types.split(",") if args.types else list(sample) if args.sample else all_types()
    started = time.perf_counter()
    results = run(types, args.jobs, args.timeout, script, describe)
    print(json.dumps({name: value for name, value in table.summarize(results).items() if name != "tasks"}))
    if args.update:
        update(results, table)
    elif not (args.types or args.sample):
        write(results, time.perf_counter() - started, args.jobs, table)
    else:
        return
    print(f"wrote {table.markdown} and {table.results}")
