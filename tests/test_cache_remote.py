"""A portable compile cache: entries checked against their checksums, and `cache push` / `cache pull`
between checkouts at different paths with different caches, through a remote folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimum_neuron_torch.compiler import cache_stats, remote
from optimum_neuron_torch.compiler.cache import CompileCache
from optimum_neuron_torch.errors import CompileCacheError
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV
from test_compile_cache import GENERATE
from testing_utils import optimum_cli
from tiny_models import PROGRAMS_PER_GRAPH, TINY_MODELS

PROGRAMS = 2 * PROGRAMS_PER_GRAPH  # the tiny llama's prefill bucket and decode step
ENTRIES = PROGRAMS + 2  # and their two compiled functions, saved for warm starts (see `compiler.precompiled`)

PACKAGE = Path(remote.__file__).parents[1]


def in_checkout(checkout: Path, cache: Path, *arguments: str) -> subprocess.CompletedProcess:
    """Runs `python ARGUMENTS` with the library imported from `checkout` (a copy of the package at
    another path) and the compile cache `cache`."""
    env = {**os.environ, "PYTHONPATH": str(checkout), COMPILE_CACHE_ENV: str(cache)}
    done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def cli_in(checkout: Path, cache: Path, *arguments: str) -> subprocess.CompletedProcess:
    code = ("import sys; from optimum.commands.optimum_cli import main; sys.argv = ['optimum-cli', 'neuron-torch', "
            + ", ".join(map(repr, arguments)) + "]; main()")
    return in_checkout(checkout, cache, "-c", code)


def generated(done: subprocess.CompletedProcess) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # (the fast tier pushes and pulls a small graph through the CLI below)
def test_graphs_pushed_from_one_checkout_warm_start_another_at_another_path(tmp_path):
    """Checkout A (one path, one cache) compiles and pushes to a remote folder; checkout B (a copy of
    the package and of the model at other paths, another cache) pulls and compiles nothing."""
    checkouts = {}
    for name in ("a", "b"):
        checkouts[name] = tmp_path / name / "checkout"
        shutil.copytree(PACKAGE, checkouts[name] / "optimum_neuron_torch",
                        ignore=shutil.ignore_patterns("__pycache__"))
    model_a = TINY_MODELS["llama"].save(tmp_path / "a" / "llama")
    model_b = shutil.copytree(model_a, tmp_path / "b" / "models" / "renamed-llama")
    cache_a, cache_b, remote_folder = tmp_path / "a" / "cache", tmp_path / "b" / "cache", tmp_path / "remote"

    cold = generated(in_checkout(checkouts["a"], cache_a, "-c", GENERATE, str(model_a)))
    assert cold["misses"] == PROGRAMS and cold["hits"] == 0
    assert f"pushed {ENTRIES} compiled graphs (0 already there" in cli_in(checkouts["a"], cache_a, "cache", "push",
                                                                 str(remote_folder)).stdout
    assert f"pushed 0 compiled graphs ({ENTRIES} already there" in cli_in(checkouts["a"], cache_a, "cache", "push",
                                                                 str(remote_folder)).stdout
    # No key, record or entry metadata names a path of checkout A. (The compiled files themselves do: the
    # kernels' debugging information and Inductor's records keep the folder they were built in; nothing
    # reads it when loading, as checkout B shows below.)
    records = sorted((remote_folder / remote.LAYOUT / "entries" / remote.GRAPH).glob("*.json"))
    for entry in CompileCache(cache_a).entries():
        assert str(tmp_path) not in (entry.path / "entry.json").read_text()
    for record in records:
        assert str(tmp_path) not in record.read_text()
    assert len(records) == ENTRIES
    for record in map(json.loads, map(Path.read_text, records)):
        blob = remote_folder / remote.LAYOUT / "blobs" / f"{record['sha256']}.tar"
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == record["sha256"]

    # A damaged blob and a foreign entry are named, skipped, and never reach B's cache
    first, second = (json.loads(path.read_text()) for path in records[:2])
    damaged = remote_folder / remote.LAYOUT / "blobs" / f"{first['sha256']}.tar"
    original = damaged.read_bytes()
    middle = len(original) // 2
    # (bytes flipped, not reordered: the middle of a small entry's archive can be all padding)
    damaged.write_bytes(original[:middle] + bytes(byte ^ 0xFF for byte in original[middle:middle + 64])
                        + original[middle + 64:])
    assert damaged.read_bytes() != original
    records[1].write_text(json.dumps({**second, "environment": {**second["environment"], "torch": "9.9.9"}}))
    (records[0].parent / "unreadable.json").write_text("{not json")
    pulled = cli_in(checkouts["b"], cache_b, "cache", "pull", str(remote_folder))
    assert f"pulled {ENTRIES - 2} compiled graphs (0 already there, 3 skipped)" in pulled.stdout
    assert "skipped graph unreadable: its record or archive cannot be read (JSONDecodeError" in pulled.stderr
    assert f"skipped graph {first['name']}: its archive's SHA-256 differs" in pulled.stderr
    assert f"skipped graph {second['name']}: compiled for another environment: torch '9.9.9' (here " in pulled.stderr
    pulled_keys = {entry.key for entry in CompileCache(cache_b).entries()}
    assert len(pulled_keys) == ENTRIES - 2 and not pulled_keys & {first["name"], second["name"]}

    damaged.write_bytes(original)
    records[1].write_text(json.dumps(second))
    (records[0].parent / "unreadable.json").unlink()
    pulled = cli_in(checkouts["b"], cache_b, "cache", "pull", str(remote_folder)).stdout
    assert f"pulled 2 compiled graphs ({ENTRIES - 2} already there, 0 skipped)" in pulled
    warm = generated(in_checkout(checkouts["b"], cache_b, "-c", GENERATE, str(model_b)))
    assert warm["misses"] == 0 and warm["hits"] == PROGRAMS
    assert (warm["traced"], warm["restored"], warm["dynamo_graphs"]) == (0, 2, 0)  # nothing traced in B either
    assert warm["tokens"] == cold["tokens"]
    assert f"pulled 0 compiled graphs ({ENTRIES} already there" in cli_in(checkouts["b"], cache_b, "cache", "pull",
                                                                 str(remote_folder)).stdout


def sine(x):
    return torch.sin(x) * 2 + x.sum()


@pytest.fixture
def compiled_sine(tmp_path, monkeypatch) -> Path:
    """A compile cache in `tmp_path/cache` holding the graph of `sine` at shape (8,)."""
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "cache"))
    torch._dynamo.reset()
    torch.compile(sine, backend="neuron", dynamic=False)(torch.randn(8).to("neuron"))
    torch._dynamo.reset()
    yield tmp_path / "cache"
    torch._dynamo.reset()


def test_cli_push_and_pull_carry_a_graph_to_another_cache(compiled_sine, tmp_path, monkeypatch):
    remote_folder, other = tmp_path / "remote", tmp_path / "other"
    pushed = optimum_cli("cache", "push", str(remote_folder), env={COMPILE_CACHE_ENV: str(compiled_sine)})
    assert pushed.returncode == 0 and "pushed 1 compiled graphs (0 already there" in pushed.stdout, pushed.stderr
    pulled = optimum_cli("cache", "pull", str(remote_folder), env={COMPILE_CACHE_ENV: str(other)})
    assert pulled.returncode == 0 and "pulled 1 compiled graphs (0 already there, 0 skipped)" in pulled.stdout
    assert remote.pull(str(remote_folder), CompileCache(other)).present == [entry.key for entry in
                                                                           CompileCache(compiled_sine).entries()]
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(other))
    before, x = cache_stats(), torch.randn(8)
    torch.testing.assert_close(torch.compile(sine, backend="neuron", dynamic=False)(x.to("neuron")).cpu(), sine(x))
    assert (cache_stats().misses, cache_stats().hits) == (before.misses, before.hits + 1)  # loaded, not compiled


@pytest.mark.parametrize("damage", ["truncated", "modified", "removed"])
def test_a_local_entry_that_does_not_match_its_checksums_is_recompiled_with_its_name(compiled_sine, damage):
    (entry,) = CompileCache(compiled_sine).entries()
    graph = entry.path / "graph.bin"
    if damage == "truncated":
        graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    elif damage == "modified":
        kernel = next(path for path in (entry.path / "kernels").rglob("*") if path.suffix in (".so", ".cpp"))
        kernel.write_bytes(kernel.read_bytes() + b"\0")
    else:
        graph.unlink()
    before = cache_stats()
    x = torch.randn(8)
    with pytest.warns(UserWarning, match=rf"Compile cache entry {entry.key} in .* is not loaded: its file .* "
                                         r"(is not the one compiled|is missing).*compiled again"):
        result = torch.compile(sine, backend="neuron", dynamic=False)(x.to("neuron"))
    torch.testing.assert_close(result.cpu(), sine(x))
    assert cache_stats().misses == before.misses + 1
    (rebuilt,) = CompileCache(compiled_sine).entries()
    assert rebuilt.key == entry.key and CompileCache(compiled_sine).get_or_build(entry.key, pytest.fail)[1] is False


def test_a_push_that_cannot_write_names_the_destination_and_leaves_the_cache_untouched(compiled_sine, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    before = {path: path.read_bytes() for path in compiled_sine.rglob("*") if path.is_file()}
    with pytest.raises(CompileCacheError, match=f"cannot push compiled graphs to {blocker / 'remote'}: "):
        remote.push(str(blocker / "remote"), CompileCache(compiled_sine))
    assert {path: path.read_bytes() for path in compiled_sine.rglob("*") if path.is_file()} == before
    with pytest.raises(CompileCacheError, match=f"{tmp_path / 'nothing'} holds no compiled graphs"):
        remote.pull(str(tmp_path / "nothing"), CompileCache(tmp_path / "other"))


@pytest.mark.slow
def test_pushes_and_pulls_at_once_leave_a_valid_remote_and_valid_caches(compiled_sine, tmp_path):
    """Two processes push the same entry into one remote while two others pull it into one cache."""
    remote_folder = tmp_path / "remote"
    remote.push(str(remote_folder), CompileCache(compiled_sine))  # (so that the pulls have something to race on)
    shutil.rmtree(remote_folder / remote.LAYOUT / "entries")
    commands = [("push", compiled_sine)] * 2 + [("pull", tmp_path / "pulled")] * 2
    code = ("import sys; from optimum_neuron_torch.compiler import remote, CompileCache; "
            "getattr(remote, sys.argv[1])(sys.argv[2], CompileCache(sys.argv[3]))")
    processes = [subprocess.Popen([sys.executable, "-c", code, verb, str(remote_folder), str(cache)],
                                  stderr=subprocess.PIPE, text=True) for verb, cache in commands]
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
    report = remote.pull(str(remote_folder), CompileCache(tmp_path / "pulled"))
    assert len(report.copied) + len(report.present) == 1 and report.skipped == []
    (entry,) = CompileCache(tmp_path / "pulled").entries()
    assert CompileCache(tmp_path / "pulled").get_or_build(entry.key, pytest.fail)[1] is False  # checksums hold
    assert not [path for path in remote_folder.rglob("*.tmp")]



def test_adding_a_damaged_entry_is_refused_naming_it(compiled_sine, tmp_path):
    """What a model saved precompiled, or a pull, hands to the cache is checked before it goes in."""
    (entry,) = CompileCache(compiled_sine).entries()
    shipped = shutil.copytree(entry.path, tmp_path / "shipped")
    (shipped / "graph.bin").write_bytes(b"not a graph")
    with pytest.raises(CompileCacheError, match=rf"compiled graph {entry.key} in {shipped} cannot be added to the "
                                                r"compile cache: its file graph.bin is not the one compiled"):
        CompileCache(tmp_path / "other").add(shipped)
    assert list(CompileCache(tmp_path / "other").entries()) == []


def test_a_pulled_entry_whose_files_do_not_match_its_checksums_is_skipped_naming_why(compiled_sine, tmp_path):
    """The blob is intact (its SHA-256 is the record's) but the entry it carries was damaged before
    the push: the pull checks the entry itself and never installs it."""
    (entry,) = CompileCache(compiled_sine).entries()
    (entry.path / "graph.bin").write_bytes(b"damaged before the push")
    remote.push(str(tmp_path / "remote"), CompileCache(compiled_sine))
    report = remote.pull(str(tmp_path / "remote"), CompileCache(tmp_path / "other"))
    assert report.copied == [] and report.present == []
    [skipped] = report.skipped
    assert skipped.startswith(f"graph {entry.key}: ") and "its file graph.bin is not the one compiled" in skipped
    assert list(CompileCache(tmp_path / "other").entries()) == []
