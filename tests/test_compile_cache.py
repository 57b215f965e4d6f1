"""The persistent cache of compiled graphs: reuse across processes, concurrent compiles, failed
compiles, models saved precompiled, and `optimum-cli neuron-torch cache`."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from optimum_neuron_torch import NeuronAutoModelForCausalLM
from optimum_neuron_torch.compiler import artifact
from optimum_neuron_torch.compiler.artifact import KERNELS_DIR
from optimum_neuron_torch.compiler.cache import CHECKSUMS, SLOTS_DIR, CompileCache, graph_key
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV as CACHE_ENV
from testing_utils import optimum_cli, run_python
from tiny_models import PROGRAMS_PER_GRAPH, TINY_MODELS

PROGRAMS = 2 * PROGRAMS_PER_GRAPH  # the tiny llama's prefill bucket and decode step
# What precompile() of batch 1, prompt bucket 16, max length 64 compiles: the engine's prefill, chunk and decode
# step (3 functions), 8 distinct programs (a program before the layers and a layer program per shape; after the
# layers, the prefill's and the decode step's)
PRECOMPILED = 8 + 3
FUNCTIONS = 2  # their compiled functions, saved for warm starts (see `compiler.precompiled`)

# Loads the tiny Llama saved in sys.argv[1] with NeuronAutoModelForCausalLM, generates once, and
# prints the tokens and the compile-cache counters as JSON.
GENERATE = """
import json, sys, time
import torch
from optimum_neuron_torch import NeuronAutoModelForCausalLM
from optimum_neuron_torch.compiler import cache_stats
model = NeuronAutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(4, 15).unsqueeze(0).to("neuron")
start = time.perf_counter()
tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
stats = cache_stats()
print(json.dumps({"tokens": tokens.cpu().tolist(), "hits": stats.hits, "misses": stats.misses,
                  "traced": stats.traced, "restored": stats.restored,
                  "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "first_call_seconds": time.perf_counter() - start}))
"""


def generate_in_subprocess(folder: Path, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", GENERATE, str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, CACHE_ENV: str(cache)})


def result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    return TINY_MODELS["llama"].save(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def filled_cache(saved_llama, tmp_path_factory) -> tuple[Path, dict]:
    """A compile cache filled by one process generating with the tiny Llama from an empty cache, and
    what that process reported. Tests that only need the graphs compiled copy it (`copy_of`)
    instead of compiling them again."""
    cache = tmp_path_factory.mktemp("filled") / "cache"
    return cache, result(generate_in_subprocess(saved_llama, cache))


def copy_of(cache: Path, destination: Path) -> Path:
    shutil.copytree(cache, destination)
    return destination


def files_in(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def vector_isa_probes_in(folder: Path) -> list[Path]:
    """Sources of the libraries with which Inductor probes the CPU's vector instruction sets (each
    defines a `__<isa>_chk_kernel`), found in `folder`."""
    return [path for path in folder.rglob("*.cpp") if "_chk_kernel" in path.read_text()]


def test_a_second_process_loads_instead_of_compiling(saved_llama, filled_cache, tmp_path):
    cache, cold = filled_cache
    copied = copy_of(cache, tmp_path / "cache")
    warm = result(generate_in_subprocess(saved_llama, copied))
    assert cold["misses"] == PROGRAMS and cold["hits"] == 0
    assert (cold["traced"], cold["restored"], cold["dynamo_graphs"]) == (FUNCTIONS, 0, FUNCTIONS)
    assert warm["misses"] == 0 and warm["hits"] == PROGRAMS
    # A warm start runs no Dynamo: the compiled functions are restored with their guards
    assert (warm["traced"], warm["restored"], warm["dynamo_graphs"]) == (0, FUNCTIONS, 0)
    assert warm["tokens"] == cold["tokens"]
    entries = list(CompileCache(copied).entries())
    assert (len(entries), sum(entry.is_function for entry in entries)) == (PROGRAMS + FUNCTIONS, FUNCTIONS)
    # Loading builds nothing: no kernel, and none of the libraries with which Inductor probes the
    # CPU's vector instruction sets (built in an entry, they were built again by every process)
    assert files_in(copied) == files_in(cache)
    assert vector_isa_probes_in(cache) == []  # (compiling probes in Inductor's shared cache too)


@pytest.mark.slow  # (the fast tier's budget: its cache tests load and reuse entries)
def test_every_entry_holds_the_library_of_each_kernel_it_loads(saved_llama, tmp_path, monkeypatch):
    """Graphs of one process that share a kernel (the same C++ source: Inductor builds it once and
    takes it from memory for the next graph) each hold its library: loading an entry in another
    process, or on another machine, builds nothing."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = NeuronAutoModelForCausalLM.from_pretrained(saved_llama)
    model.precompile(batch_sizes=(1,), prompt_buckets=(16, 32), max_length=64, show_progress=False, sampling=False)
    entries = [entry for entry in CompileCache(tmp_path).entries() if not entry.is_function]
    sources = [source for entry in entries for source in entry.path.rglob("*.cpp")]
    assert len({source.name for source in sources}) < len(sources)  # (kernels shared between graphs)
    assert [source for source in sources if not source.with_suffix(".so").is_file()] == []
    assert all(f"{KERNELS_DIR}/{source.relative_to(entry.path / KERNELS_DIR).with_suffix('.so')}"
               in entry.metadata[CHECKSUMS] for entry in entries for source in entry.path.rglob("*.cpp"))


@pytest.mark.slow  # (the fast tier's budget: its cache tests load and reuse entries)
def test_a_kernel_is_built_once_whichever_graph_or_process_needs_it(saved_llama, tmp_path, monkeypatch):
    """Inductor builds C++ kernels in a folder of the compile cache shared by every process (and rank),
    and each entry holds the very libraries built there: the graphs of a later process (here: this one
    with Inductor's memory of its kernels cleared) that share a kernel with earlier ones do not build
    it again. Every library of every entry is then one file per kernel, and each entry stays whole."""
    from torch._inductor import codecache

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = NeuronAutoModelForCausalLM.from_pretrained(saved_llama)
    model.precompile(batch_sizes=(1,), prompt_buckets=(16,), max_length=64, show_progress=False, sampling=False)
    first = {entry.key for entry in CompileCache(tmp_path).entries()}
    for memory in (codecache.CppCodeCache.cache, codecache.CppPythonBindingsCodeCache.cache):
        memory.clear()  # (as in a new process; later graphs load their libraries again from their entries)
    monkeypatch.setattr(artifact, "_kernel_libraries", {})
    model.precompile(batch_sizes=(1,), prompt_buckets=(32,), max_length=64, show_progress=False, sampling=False)
    entries = [entry for entry in CompileCache(tmp_path).entries() if not entry.is_function]
    libraries = [library for entry in entries for library in entry.path.rglob("*.so")]
    later = [library.name for entry in entries if entry.key not in first for library in entry.path.rglob("*.so")]
    earlier = {library.name for entry in entries if entry.key in first for library in entry.path.rglob("*.so")}
    assert set(later) & earlier  # (the later graphs share kernels with the earlier ones)
    assert len({library.stat().st_ino for library in libraries}) == len({library.name for library in libraries})
    assert all(entry.path.joinpath(name).is_file() for entry in entries for name in entry.metadata[CHECKSUMS])


def test_the_vector_isa_probe_runs_once_per_compile_environment(tmp_path, monkeypatch):
    """Inductor's probe of the vector instruction sets the compiler and CPU support (a library built
    and loaded in a subprocess per set) runs once per compile environment: the sets found are
    recorded in the compile cache, and a process finding a record that lists every set the CPU has
    takes them without probing."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    found = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    probes = []
    check_build = cpu_vec_isa.VecISA.check_build
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build",
                        lambda isa, code: probes.append(str(isa)) or check_build(isa, code))

    def new_process() -> list[str]:  # (the sets a new process finds)
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()
        artifact._probe_vector_isa()
        return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]

    probed = platform.machine() in ("x86_64", "AMD64")  # (where Inductor probes each set)
    assert new_process() == found and bool(probes) == probed  # (no record yet: Inductor probes)
    (record,) = (tmp_path / SLOTS_DIR).glob("vector-isa-*.json")
    assert json.loads(record.read_text()) == found
    probes.clear()
    assert new_process() == found and probes == []  # (recorded: no probe)
    record.write_text(json.dumps(found[1:]))  # (a set that failed its probe there: probed again)
    assert new_process() == found and bool(probes) == probed
    assert json.loads(record.read_text()) == found


@pytest.mark.slow
def test_two_processes_compiling_the_same_graphs_leave_one_valid_entry_each(saved_llama, tmp_path):
    processes = [generate_in_subprocess(saved_llama, tmp_path / "cache") for _ in range(2)]
    first, second = (result(process) for process in processes)
    assert first["tokens"] == second["tokens"]
    assert first["misses"] + second["misses"] == PROGRAMS  # each compiled once; the other process waited and loaded it
    entries = list(CompileCache(tmp_path / "cache").entries())
    assert len(entries) == PROGRAMS + FUNCTIONS
    assert not any((tmp_path / "cache" / "tmp").iterdir())
    assert result(generate_in_subprocess(saved_llama, tmp_path / "cache"))["misses"] == 0  # the entries load


def test_a_failed_compile_leaves_nothing_that_blocks_a_retry(tmp_path):
    cache = CompileCache(tmp_path)

    def failing(folder: Path) -> dict:
        (folder / "graph.bin").write_bytes(b"half written")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get_or_build("ab" * 32, failing)
    assert cache.get("ab" * 32) is None and not any((tmp_path / "tmp").iterdir())
    entry, built = cache.get_or_build("ab" * 32, lambda folder: (folder / "graph.bin").write_bytes(b"ok") and {})
    assert built and (entry.path / "graph.bin").read_bytes() == b"ok"
    assert entry.path == tmp_path / "ab" / "ab" / ("ab" * 32)  # sharded by key prefix
    assert cache.get_or_build("ab" * 32, lambda folder: pytest.fail("built twice")) == (entry, False)


def test_concurrent_builders_in_one_process_build_once(tmp_path):
    cache = CompileCache(tmp_path)
    built = []

    def build(folder: Path) -> dict:
        built.append(folder)
        return {}

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: cache.get_or_build("cd" * 32, build), range(4)))
    assert len(built) == 1 and sum(was_built for _, was_built in results) == 1


def test_an_entry_that_does_not_match_its_checksums_is_named_removed_and_rebuilt(tmp_path):
    cache = CompileCache(tmp_path)
    key = "ef" * 32
    entry, _ = cache.get_or_build(key, lambda folder: (folder / "graph.bin").write_bytes(b"good") and {})
    (entry.path / "graph.bin").write_bytes(b"evil")  # (same size: only the checksum tells)
    with pytest.warns(UserWarning) as caught:
        rebuilt, built = cache.get_or_build(key, lambda folder: (folder / "graph.bin").write_bytes(b"new") and {})
    assert built and (rebuilt.path / "graph.bin").read_bytes() == b"new" and rebuilt.path == entry.path
    [warning] = caught
    assert str(warning.message) == (f"Compile cache entry {key} in {tmp_path} is not loaded: its file graph.bin is "
                                    "not the one compiled (SHA-256 differs: truncated or modified). Its graph is "
                                    "compiled again.")
    assert [path.name for path in (tmp_path / "tmp").iterdir()] == []  # the discarded entry is gone
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ef", "locks", "tmp"]  # (renamed within the cache)
    metadata = json.loads((rebuilt.path / "entry.json").read_text())
    del metadata["files"]  # (an entry written before entries recorded checksums)
    (rebuilt.path / "entry.json").write_text(json.dumps(metadata))
    with pytest.warns(UserWarning) as caught:
        cache.get_or_build(key, lambda folder: {})
    assert str(caught[0].message).endswith(": it records no checksums of its files (written by an older version of "
                                           "the library). Its graph is compiled again.")
    shutil.rmtree(rebuilt.path)
    with pytest.warns(UserWarning, match="not loaded: gone"):
        cache.discard(key, "gone")  # already removed (by another process): nothing to do, no error
    assert cache.get(key) is None and [path.name for path in (tmp_path / "tmp").iterdir()] == []


@pytest.mark.slow  # (the fast tier's test_commands.py compiles, saves and reloads a model precompiled)
def test_a_model_saved_precompiled_arrives_precompiled(saved_llama, filled_cache, tmp_path):
    """precompile() then save_pretrained() (the graphs come from the first process's cache); a new
    process with an empty compile cache loads the saved graphs and compiles nothing."""
    code = f"""
        from optimum_neuron_torch import NeuronAutoModelForCausalLM
        model = NeuronAutoModelForCausalLM.from_pretrained({str(saved_llama)!r})
        model.precompile(batch_sizes=(1,), prompt_buckets=(16,), max_length=64, show_progress=False)
        model.save_pretrained({str(tmp_path / "precompiled")!r})
    """
    done = run_python(code, env={CACHE_ENV: str(copy_of(filled_cache[0], tmp_path / "first"))})
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads((tmp_path / "precompiled" / "neuron_generation.json").read_text())
    assert spec["buckets"] == {"batch_sizes": [1], "prompt_buckets": [16], "max_length": 64, "context_buckets": [64]}
    assert len(spec["graphs"]) == PRECOMPILED
    assert all((tmp_path / "precompiled" / "neuron_compiled" / key).is_dir() for key in spec["graphs"])

    arrived = result(generate_in_subprocess(tmp_path / "precompiled", tmp_path / "second"))
    assert arrived["misses"] == 0 and arrived["hits"] == PROGRAMS


@pytest.mark.slow
def test_a_second_model_of_the_same_shapes_saves_its_graphs_too(saved_llama, tmp_path):
    """Dynamo runs the graphs compiled for the first model again for the second without asking the
    backend: the second model must still know (and save) its graphs."""
    models = [NeuronAutoModelForCausalLM.from_pretrained(saved_llama) for _ in range(2)]
    for model in models:
        model.precompile(batch_sizes=(1,), prompt_buckets=(16,), max_length=64, show_progress=False)
    assert len(models[1].neuron_generation.cache_keys) == PRECOMPILED
    assert models[1].neuron_generation.cache_keys == models[0].neuron_generation.cache_keys
    models[1].save_pretrained(tmp_path / "second")
    saved = json.loads((tmp_path / "second" / "neuron_generation.json").read_text())
    assert len(saved["graphs"]) == PRECOMPILED


def test_graphs_saved_in_another_environment_are_recompiled_with_a_message(saved_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved_llama, folder)
    spec = {"buckets": {"batch_sizes": [1], "prompt_buckets": [16], "max_length": 64}, "compile_config": {},
            "environment": {"torch": "1.0.0"}, "graphs": []}
    (folder / "neuron_generation.json").write_text(json.dumps(spec))
    from optimum_neuron_torch import NeuronAutoModelForCausalLM

    with pytest.warns(UserWarning,
                      match=r"compiled in another environment \(.*torch: saved '1.0.0'.*compiled again on first use"):
        model = NeuronAutoModelForCausalLM.from_pretrained(folder)
    assert model.neuron_generation.buckets.prompt_buckets == (16,)


def test_graphs_saved_by_another_release_of_the_library_load_without_a_message(saved_llama, tmp_path):
    """A release that leaves the code generation alone keeps every saved graph (the environment names
    what changes a graph, not the library's version)."""
    from optimum_neuron_torch.compiler.artifact import compile_environment

    folder = tmp_path / "model"
    shutil.copytree(saved_llama, folder)
    spec = {"buckets": {"batch_sizes": [1], "prompt_buckets": [16], "max_length": 64}, "compile_config": {},
            "environment": {**compile_environment(), "optimum_neuron_torch": "0.0.1"}, "graphs": []}
    (folder / "neuron_generation.json").write_text(json.dumps(spec))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*another environment")
        NeuronAutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("listing, same", [
    ("  -march=  znver3\n  -mavx2  [enabled]\n  -mavx512f  [enabled]\n  -mamx-tile  [disabled]\n", True),
    ("  -march=  znver3\n  -mavx2  [enabled]\n  -mavx512f  [enabled]\n  -mamx-tile  [enabled]\n", False),
    ("  -march=  znver4\n  -mavx2  [enabled]\n  -mavx512f  [enabled]\n  -mamx-tile  [disabled]\n", False),
], ids=["an unused flag differs", "an instruction set differs", "the architecture differs"])
def test_the_cpu_counts_by_the_instruction_sets_its_kernels_are_built_for(tmp_path, listing, same):
    from optimum_neuron_torch.compiler.artifact import _native_target

    def compiler(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\nprintf '%s' '{text}'\n")
        path.chmod(0o755)
        return str(path)
    base = "  -march=  znver3\n  -mavx2  [enabled]\n  -mavx512f  [enabled]\n  -mhle  [disabled]\n"
    assert (_native_target(compiler("a", base)) == _native_target(compiler("b", listing))) is same
    assert len({_native_target(compiler("a", base)), _native_target(str(tmp_path / "absent"))}) == 2


def test_cli_lists_reports_and_clears_the_cache(filled_cache, tmp_path):
    copy_of(filled_cache[0], tmp_path / "cache")

    def cli(*args: str) -> str:
        done = optimum_cli("cache", *args, env={CACHE_ENV: str(tmp_path / "cache")})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    listed = cli("list")
    assert listed.startswith(f"{PROGRAMS} compiled graphs and {FUNCTIONS} compiled functions in {tmp_path / 'cache'}")
    assert listed.count("function optimum_neuron_torch.generation.slots.slot_step") == FUNCTIONS
    assert f"graphs: {PROGRAMS}\ncompiled functions (warm starts without tracing): {FUNCTIONS}" in cli("stats")
    assert f"removed {PROGRAMS + FUNCTIONS} compiled graphs and functions" in cli("clear")
    assert "graphs: 0" in cli("stats")


def test_the_key_tells_shapes_strides_dtypes_environments_and_options_apart():
    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) * 2)
    environment, options = {"torch": torch.__version__}, {}
    base = torch.empty(4, 6)
    variants = [
        [base],
        [torch.empty(6, 4)],  # shape
        [torch.empty(6, 4).t()],  # same shape (4, 6), other strides
        [torch.empty(4, 6, dtype=torch.bfloat16)],  # dtype
    ]
    keys = [graph_key(gm, inputs, environment, options) for inputs in variants]
    keys.append(graph_key(gm, [base], {"torch": "0.0"}, options))
    keys.append(graph_key(gm, [base], environment, {"max_autotune": True}))
    with torch.autocast("neuron", dtype=torch.bfloat16):  # Trainer's bf16: AOTAutograd traces the casts in
        keys.append(graph_key(gm, [base], environment, options))
    assert len(set(keys)) == len(keys)
    assert graph_key(gm, [torch.empty(4, 6)], dict(environment), {}) == keys[0]  # the same description, the same key


def test_one_function_compiled_at_two_shapes_is_two_entries_with_right_results(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    torch._dynamo.reset()

    def function(x):
        return torch.sin(x) * 2 + x.sum()

    compiled = torch.compile(function, backend="neuron", dynamic=False)
    for size in (4, 8):
        x = torch.randn(size)
        torch.testing.assert_close(compiled(x.to("neuron")).cpu(), function(x))
    entries = list(CompileCache(tmp_path / "cache").entries())
    assert sorted(entry.metadata["input_shapes"] for entry in entries) == [[[4]], [[8]]]
    torch._dynamo.reset()
