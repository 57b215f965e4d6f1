"""Warm starts without tracing (`compiler.precompiled`): a compiled function saved with its guards
is restored, not traced, by the next process (here: a new `PrecompiledFunction` after Dynamo's
reset; across real processes, see test_compile_cache.py); a damaged, stale or refused one is never
run: a warning names the entry and why, and the function is traced again."""

from __future__ import annotations

import importlib
import json
import linecache
import shutil
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from optimum_neuron_torch.compiler import cache_stats, precompiled, reset_cache_stats
from optimum_neuron_torch.compiler.cache import CHECKSUMS, METADATA, CompileCache, folder_checksums
from optimum_neuron_torch.compiler.precompiled import FUNCTION_FILE, PrecompiledFunction
from optimum_neuron_torch.device import backend_info
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV

OPTIONS = {"fullgraph": True, "dynamic": False}
HELPER = "def scale(x):\n    return x * {}\n"


class Config:
    def __init__(self, width: int = 8, eps: float = 1e-6) -> None:
        self.width, self.eps = width, eps

    def to_dict(self) -> dict:
        return dict(vars(self))


class Tiny(torch.nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(config.width, config.width)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)) + self.config.eps


def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    import helper_module  # (a module the test rewrites: a source Dynamo inlines)

    return helper_module.scale(model(x).relu())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> CompileCache:
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "helper_module.py").write_text(HELPER.format(2))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("helper_module", None)
    new_process()
    yield CompileCache(tmp_path / "cache")
    sys.modules.pop("helper_module", None)


def new_process() -> None:
    """What a new process starts from: nothing traced, nothing counted."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    reset_cache_stats()


def run(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`step` through a new `PrecompiledFunction` (a new process's), compared with eager on the CPU."""
    with torch.no_grad():
        got = PrecompiledFunction(step, OPTIONS, backend="neuron")(model.to("neuron"), x.to("neuron")).cpu()
        torch.testing.assert_close(got, step(model.cpu(), x), rtol=1e-5, atol=1e-5)
    return got


def counts() -> tuple[int, int, int]:
    """(functions traced, functions restored, graphs Dynamo traced) since `new_process()`."""
    stats = cache_stats()
    return stats.traced, stats.restored, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def model_and_input(**config) -> tuple[Tiny, torch.Tensor]:
    torch.manual_seed(0)
    return Tiny(Config(**config)).eval(), torch.randn(2, 8)


def function_entry(cache: CompileCache):
    (entry,) = [entry for entry in cache.entries() if entry.is_function]
    return entry


def test_a_new_process_restores_the_function_instead_of_tracing_it(cache):
    model, x = model_and_input()
    run(model, x)
    assert counts() == (1, 0, 1) and cache_stats().misses == 1
    new_process()
    run(model, x)
    assert counts() == (0, 1, 0)  # no Dynamo: restored with its guards
    assert (cache_stats().hits, cache_stats().misses) == (1, 0)  # its graph: a hit of the compile cache
    assert json.loads((function_entry(cache).path / METADATA).read_text())["function"].endswith(".step")
    run(model, torch.randn(3, 8))  # another shape: another function
    assert counts() == (1, 1, 1)


def test_saved_names_the_entries_of_a_call_the_cache_holds_whole(cache, monkeypatch):
    """`saved()` (what lets the server start before loading its graphs): the entries of the function
    and of every program it ran, once its first call noted them; None before, when one is gone, and
    on TorchNeuron (whose NEFF cache holds the programs). It loads nothing."""
    model, x = model_and_input()
    model, device_x = model.to("neuron"), x.to("neuron")
    with torch.no_grad():
        assert PrecompiledFunction(step, OPTIONS, backend="neuron").saved(model, device_x) is None
        run(model, x)  # (compared with the model on the CPU: it is moved back)
        new_process()
        keys = PrecompiledFunction(step, OPTIONS, backend="neuron").saved(model.to("neuron"), device_x)
        assert keys == {entry.key for entry in cache.entries()} and len(keys) == 2  # (the function, its program)
        assert counts() == (0, 0, 0) and cache_stats().hits == 0
        monkeypatch.setattr(precompiled, "backend_info", lambda: SimpleNamespace(compiles_itself=True))
        assert PrecompiledFunction(step, OPTIONS, backend="neuron").saved(model, device_x) is None
        monkeypatch.setattr(precompiled, "backend_info", backend_info)
        shutil.rmtree(next(entry for entry in cache.entries() if not entry.is_function).path)
        assert PrecompiledFunction(step, OPTIONS, backend="neuron").saved(model, device_x) is None


def test_a_damaged_or_foreign_function_is_never_run(cache):
    model, x = model_and_input()
    run(model, x)
    entry = function_entry(cache)
    data = bytearray((entry.path / FUNCTION_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry.path / FUNCTION_FILE).write_bytes(bytes(data))
    new_process()
    with pytest.warns(UserWarning, match=f"entry {entry.key} .* is not loaded: .*{FUNCTION_FILE}"):
        run(model, x)
    assert counts() == (1, 0, 1)
    # A file that matches its checksums but is not a saved function (written by another version)
    entry = function_entry(cache)
    (entry.path / FUNCTION_FILE).write_bytes(b"not a function")
    metadata = json.loads((entry.path / METADATA).read_text())
    (entry.path / METADATA).write_text(json.dumps({**metadata, CHECKSUMS: folder_checksums(entry.path)}))
    new_process()
    with pytest.warns(UserWarning, match=f"entry {entry.key} .* is not loaded: it does not load \\("):
        run(model, x)
    assert counts() == (1, 0, 1)


def test_a_function_whose_traced_source_changed_is_traced_again(cache, tmp_path):
    model, x = model_and_input()
    assert run(model, x).equal(2 * torch.relu(model(x)))
    (tmp_path / "helper_module.py").write_text(HELPER.format(3))
    linecache.checkcache()
    importlib.reload(sys.modules["helper_module"])
    new_process()
    with pytest.warns(UserWarning, match=r"the source it traced changed since \(helper_module, lines 1-3\)"):
        assert run(model, x).equal(3 * torch.relu(model(x)))
    assert counts() == (1, 0, 1)


def test_a_function_its_guards_refuse_is_traced_again(cache):
    model, x = model_and_input()
    run(model, x)
    new_process()
    model.train()  # (dropout traced in eval mode: the key holds shapes and config, the guards the mode)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"its guards refuse this call \(.*training"):
        PrecompiledFunction(step, OPTIONS, backend="neuron")(model.to("neuron"), x.to("neuron"))
    assert counts() == (1, 0, 1)


def test_a_function_saved_for_another_config_is_named_when_not_used(cache):
    model, x = model_and_input()
    run(model, x)
    new_process()
    model.config.eps = 1e-3  # (the same shapes: the saved function would have run, with the wrong constant)
    with pytest.warns(UserWarning, match=r"\.step saved for this call was not used: the config\. It is traced"):
        run(model, x)
    assert counts() == (1, 0, 1)



def test_frozen_weights_are_keyed_apart_from_trainable_ones(cache):
    """Dynamo guards on each parameter's requires_grad: a function saved for trainable weights is
    not the frozen model's (named as a change of the weights, never tried and refused)."""
    model, x = model_and_input()
    run(model, x)
    new_process()
    model.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"\.step saved for this call was not used: the weights\. It is traced"):
        run(model, x)
    assert counts() == (1, 0, 1)


def doubled(self: Tiny, x: torch.Tensor) -> torch.Tensor:
    return 2 * self.linear(x)


def test_a_function_whose_guards_cannot_be_saved_runs_unsaved_and_gives_its_memory_back(cache):
    """A method set on one instance (what a scoped patch does) has guards Dynamo cannot save: the
    function is compiled as plain torch.compile, and nothing of the failed save keeps the model."""
    import gc
    import types

    model, x = model_and_input()
    expected = step(model, x)
    gc.collect()
    before = torch.neuron.memory_allocated()
    model.to("neuron").forward = types.MethodType(doubled, model)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"step cannot be saved for warm starts \(PackageError"):
        got = PrecompiledFunction(step, OPTIONS, backend="neuron")(model, x.to("neuron")).cpu()
    torch.testing.assert_close(got, 2 * expected, rtol=1e-5, atol=1e-5)
    assert not [entry for entry in cache.entries() if entry.is_function]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # (the trace that failed to save, then)
    new_process()  # the next process knows: one trace, unsaved
    with torch.no_grad(), pytest.warns(UserWarning, match=r"PackageError.*noted by an earlier run"):
        PrecompiledFunction(step, OPTIONS, backend="neuron")(model, x.to("neuron"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    del model
    torch._dynamo.reset()  # (plain torch.compile's own cache entries hold the model until reset)
    gc.collect()
    assert torch.neuron.memory_allocated() == before


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def test_a_function_restores_whatever_models_the_process_made_before(cache):
    """Transformers records each model class a process makes (`_CAN_RECORD_REGISTRY`, in the order
    made) and a model's forward reads its entry, which Dynamo reaches by its place in that order. A
    function saved by a process that made other models first is restored by one that made this
    model only: no warning, no tracing, the CPU's logits."""
    from transformers.utils import output_capturing

    from tiny_models import TINY_MODELS

    registry = output_capturing._CAN_RECORD_REGISTRY
    torch.manual_seed(0)
    model, ids = TINY_MODELS["llama"].build().eval(), torch.randint(4, 100, (1, 6))
    made = dict(registry)  # (this process's models, this one among them)
    with torch.no_grad():
        expected = logits_of(model, ids)
    model.to("neuron")
    try:
        dict.clear(registry)  # (a process that made more models before this one)
        dict.update(registry, {f"<class 'earlier.Model{index}'>": {} for index in range(len(made) + 1)})
        dict.update(registry, made)
        with torch.no_grad():
            PrecompiledFunction(logits_of, OPTIONS, backend="neuron")(model, ids.to("neuron"))
        assert counts()[0] == 1
        new_process()
        dict.clear(registry)
        dict.update(registry, made)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", UserWarning)  # (a function that is not restored is named by one)
            restored = PrecompiledFunction(logits_of, OPTIONS, backend="neuron")(model, ids.to("neuron")).cpu()
        assert counts() == (0, 1, 0)
        torch.testing.assert_close(restored, expected, rtol=1e-5, atol=1e-5)
    finally:
        dict.clear(registry)
        dict.update(registry, made)
