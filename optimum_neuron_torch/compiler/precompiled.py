"""Warm starts without tracing: a compiled function of the model saved with its guards, so that a
new process runs it without Dynamo.

PyTorch's AOT precompile (`torch.compile(...).aot_compile`) traces a function once and returns it
with its guards, serializable when the backend's product is (`SerializableCallable`). The backend's
product here is a `SavedGraph`: Dynamo's graph kept as data, compiled by the library's backend
(`regions.backend`, or the device's `neuron`) when first called. So a saved function is Dynamo's
output (the bytecode around the graph, the guards, the graph) and nothing of the backend's but its
name: loading one runs no Dynamo, and its graph's programs are hits of the compile cache (on
TorchNeuron, of its NEFF cache).

Saved functions are compile-cache entries (`cache push`/`pull` carry them), keyed by all a traced
function depends on (see `PrecompiledFunction._dependencies`), no path. When a function saved for
the same call under other dependencies is not used, a warning names what changed. One that does
not match its checksums, does not load, whose traced sources changed since (an edited
Transformers) or whose guards refuse the call is never run: a warning names the entry and why,
and the function is traced again.

Example:
    >>> step = PrecompiledFunction(logits_of, {"fullgraph": True}, backend="neuron")  # doctest: +SKIP
    >>> logits = step(model, ids)  # doctest: +SKIP  (traced once per machine, then loaded)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import logging
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.aot_compile import AOTCompiledFunction

from ..device import backend_info
from ..errors import first_line
from ..version import __version__
from . import artifact
from .cache import FUNCTION_KIND, SLOTS_DIR, STATS, CompileCache, autocast_state, write_atomically
from .dynamo_backend import note_cache_key, recording_cache_keys
from .saved_graph import GraphNotReplayable, SavedGraph, backend_named

logger = logging.getLogger(__name__)

FUNCTION_FILE = "function.bin"


class _NotSaveable(Exception):
    """A function traced, whose guards or code cannot be saved."""


def portable_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's guard filter keeping the guards a saved function can check in another process:
    not those on globals or object identities (`ID_MATCH`, ...: meaningless elsewhere; the key of
    the entry covers the model and the sources instead), nor those reaching into closures (the
    `kernels` package's layers guard on their functions' cells) or on classes defined in a local
    scope, nor Dynamo's global state guard: it holds the number of threads, which does not change
    what runs on the device; the modes that do are part of the key and checked before each call
    (see `PrecompiledFunction`)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (entry.is_global or entry.guard_type in (*unsupported, "GLOBAL_STATE")
                 or any(kind in unsupported for kind in entry.derived_guard_types or ())
                 or getattr(entry.orig_guard, "_unserializable", False) or "__closure__" in entry.name
                 or (entry.guard_type == "TYPE_MATCH" and entry.has_value and id(entry.value) in _seen_as_base)
                 or any(f"type({argument})" in entry.name or f"type(L['{argument}'])" in entry.name
                        for argument in _seen_as_base.values()))
            for entry in entries]


class PrecompiledFunction:
    """`torch.compile(function, backend=..., **options)` whose compiled functions (one per input
    shape) are saved in the compile cache and loaded, not traced, by the next process (see the
    module's docstring). The function takes the model as its first argument.

    Args:
        function: a module-level function of the model (what gets traced).
        options: `torch.compile`'s options (`fullgraph` must be true: AOT precompile takes whole graphs).
        backend: the backend compiling each graph, `"module:function"` or a Dynamo backend's name.
    """

    def __init__(self, function: Callable[..., Any], options: dict[str, Any], backend: str) -> None:
        self.function, self.backend = function, backend
        # (`mode` goes: torch.compile takes it or `options`, which carries the guard filter; the device's
        # backend compiles every mode as the default one)
        self.options = {name: value for name, value in options.items() if name not in ("options", "mode")}
        compile_options = {**(options.get("options") or {}), "guard_filter_fn": portable_guards}
        self._compiler = torch.compile(function, backend=self._saved_graph, options=compile_options, **self.options)
        self._functions: list[tuple[str, str, AOTCompiledFunction]] = []  # (most recently used first)
        self._lock = threading.Lock()
        self._unsaved: Callable[..., Any] | None = None  # (once a trace cannot be saved: plain torch.compile)
        self._traced: set[str] = set()  # (the keys traced by this process)

    def _saved_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> SavedGraph:
        return SavedGraph.from_dynamo(gm, example_inputs, self.backend)

    def __call__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._unsaved is not None:
            return self._unsaved(model, *args, **kwargs)
        modes = _modes()
        for index, (key, traced_in, compiled) in enumerate(self._functions):
            if traced_in == modes and compiled.guard_check(model, *args, **kwargs):
                if index:
                    self._functions.insert(0, self._functions.pop(index))
                return self._run(key, compiled, model, args, kwargs)
        with self._lock:
            try:
                key, compiled = self._load_or_trace(model, args, kwargs)
            except _NotSaveable as error:
                return self._unsaveable(error, model, args, kwargs)
            self._functions.insert(0, (key, modes, compiled))
        with recording_cache_keys() as ran:  # (its first call here: the programs it runs are noted for `saved`)
            result = self._run(key, compiled, model, args, kwargs)
        note = _programs_note(CompileCache(), key)
        if not note.is_file():
            write_atomically(note, json.dumps(sorted(ran - {key})))
        return result

    def saved(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> set[str] | None:
        """The compile-cache entries a call would run, when the cache holds them all: its function
        and every program the function ran when a process first called it (noted beside the
        entries); otherwise None. Loads and runs nothing (see `GenerationEngine.warm_up`). Always
        None on TorchNeuron: its programs are in its NEFF cache, which cannot be asked about a graph
        without lowering it."""
        if self._unsaved is not None or backend_info().compiles_itself:
            return None
        key = _digest(self._dependencies(model, args, kwargs))
        cache = CompileCache()
        try:
            keys = {key, *json.loads(_programs_note(cache, key).read_text())}
        except (OSError, ValueError):
            return None
        return keys if all(cache.get(entry) is not None for entry in keys) else None

    def _run(self, key: str, compiled: AOTCompiledFunction, model: torch.nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        note_cache_key(key)
        try:
            return compiled(model, *args, **kwargs)
        except GraphNotReplayable as error:  # (its graph compiles on its first call)
            with self._lock:
                self._functions = [function for function in self._functions if function[0] != key]
                cache = CompileCache()
                cache.discard(key, str(error))
                write_atomically(_unsaveable_note(cache, key), str(error))
                return self._unsaveable(error, model, args, kwargs)

    def _unsaveable(self, error: Exception, model: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """From now on, `function` through plain `torch.compile` (traced in each process), with a warning."""
        warnings.warn(f"{self.function.__qualname__} cannot be saved for warm starts ({error}): it is traced "
                      "again in each process.", stacklevel=3)
        self._unsaved = torch.compile(self.function, backend=backend_named(self.backend), **self.options)
        return self._unsaved(model, *args, **kwargs)

    def _load_or_trace(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> tuple[str, AOTCompiledFunction]:
        dependencies = self._dependencies(model, args, kwargs)
        key = _digest(dependencies)
        if key in self._traced:  # (its guards refused a call of the shapes it was traced for)
            compiled = next(compiled for traced, _, compiled in self._functions if traced == key)
            raise _NotSaveable(f"the guards of a function traced here refuse a call it was traced for: "
                               f"{_refusal(compiled, model, args, kwargs)}")
        cache = CompileCache()
        note = _unsaveable_note(cache, key)  # (why an earlier process could not save it)
        if note.is_file():
            raise _NotSaveable(f"{note.read_text()}; noted by an earlier run in {note}")
        traced: list[AOTCompiledFunction] = []

        def trace(folder: Path) -> dict[str, Any]:
            _warn_miss(_explain_miss(cache, dependencies), dependencies)
            try:
                with (_importable_class(model, next(iter(inspect.signature(self.function).parameters))),
                      _global_key_orders_left_out()):
                    compiled = self._compiler.aot_compile(((model, *args), kwargs))
            except torch._dynamo.exc.PackageError as error:  # (its guards cannot be saved)
                _release_guard_manager(error)
                raise _NotSaveable(f"{type(error).__name__}: {first_line(error)}") from error
            except torch._dynamo.exc.TorchDynamoException:  # (Dynamo's own: the caller's to handle)
                raise
            except Exception as error:  # (what saving the guards raises, e.g. a PicklingError: retried unsaved)
                raise _NotSaveable(f"{type(error).__name__}: {first_line(error)}") from error
            try:
                data = AOTCompiledFunction.serialize(compiled).serialized_data
            except Exception as error:  # (what pickling an object of the traced code raises)
                raise _NotSaveable(f"{type(error).__name__}: {first_line(error)}") from error
            (folder / FUNCTION_FILE).write_bytes(data)
            traced.append(compiled)
            STATS.traced += 1
            return {"kind": FUNCTION_KIND, "function": dependencies["function"]["name"],
                    "environment": dependencies["environment"], "modules": self._modules_referenced(compiled)}

        try:
            entry, built = cache.get_or_build(key, trace)
        except _NotSaveable as error:  # (the next process compiles it unsaved at once: no trace lost)
            write_atomically(note, str(error))
            raise
        if built:
            self._traced.add(key)
            _remember_slot(cache, dependencies, key)
            compiled = traced[0]
        else:
            problem, compiled = _restore(entry.path / FUNCTION_FILE, self.function, entry.metadata.get("modules", {}),
                                         model, args, kwargs)
            if problem is not None:
                cache.discard(key, problem)
                return self._load_or_trace(model, args, kwargs)
            STATS.restored += 1
        compiled.disable_guard_check()  # (checked before each call, in `__call__`)
        return key, compiled

    def _modules_referenced(self, compiled: AOTCompiledFunction) -> dict[str, str]:
        """The modules Dynamo's code reaches through names it added to the traced function's globals
        (`___module_collections_...`), by name: a new process has not added them."""
        refs = compiled._artifacts.runtime_env.external_refs  # (no public accessor in torch 2.13)
        return {name: value.__name__ for name in refs
                if isinstance(value := self.function.__globals__.get(name), types.ModuleType)}

    def _dependencies(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """All a traced function depends on, by field (see the module's docstring)."""
        import transformers

        config = model.config.to_dict() if hasattr(model, "config") else {}
        for name in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash"):
            config.pop(name, None)
        layout = [(name, tuple(tensor.shape), str(tensor.dtype), tensor.device.type, tensor.requires_grad)
                  for name, tensor in (*model.named_parameters(), *model.named_buffers())]
        return {
            "function": {"name": f"{self.function.__module__}.{self.function.__qualname__}",
                         "source": _source_digest(self.function), "backend": self.backend,
                         "options": repr(sorted(self.options.items()))},
            # (the trace inlines Transformers' code and the library's, so both versions count here; the graphs
            # it calls are keyed by their content)
            "environment": {**artifact.compile_environment(), "transformers": transformers.__version__,
                            "optimum_neuron_torch": __version__},
            "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else None,  # (graphs per rank)
            "model": type(model).__qualname__,
            "config": _digest(config),
            "weights": _digest(layout),
            "inputs": _describe((args, kwargs)),
            "modes": _modes(),
        }


_seen_as_base: dict[int, str] = {}  # (the models traced as their importable base class: id -> argument name)


@contextlib.contextmanager
def _importable_class(model: torch.nn.Module, argument: str) -> Iterator[None]:
    """Inside the block, `model` is an instance of the nearest class of its own that pickles by
    name: a saved function's guards hold the model's structure, with its class by name, and a class
    made at run time (the library's model classes with compiled generation) does not resolve by its
    name. The guards on the model's type (argument `argument` of the traced function) are then left
    out (see `portable_guards`): the type traced is not the one called; the entry's key holds it."""
    cls = type(model)
    base = next(klass for klass in cls.__mro__ if issubclass(klass, torch.nn.Module) and _importable(klass))
    if base is cls:
        yield
        return
    model.__class__ = base
    _seen_as_base[id(model)] = argument
    try:
        yield
    finally:
        model.__class__ = cls
        _seen_as_base.pop(id(model), None)


@contextlib.contextmanager
def _global_key_orders_left_out() -> Iterator[None]:
    """While a function is traced to be saved: the dicts held by globals whose key order Dynamo
    records (it reaches an item by its key's place: Transformers' `_CAN_RECORD_REGISTRY`, keyed by
    the model classes a process made, in the order it made them) are left out of the saved guards,
    as `portable_guards` leaves out every guard on globals. Kept, a process that made other models
    first cannot rebuild the guards (an IndexError at the key's place) and traces again."""
    from torch._dynamo import guards

    pickle_guards_state = guards.pickle_guards_state

    def without_global_key_orders(state: Any, builder: Any) -> bytes:
        orders = state.output_graph.guard_on_key_order
        state.output_graph.guard_on_key_order = {source for source in orders
                                                 if guards.get_global_source_name(source) is None}
        return pickle_guards_state(state, builder)

    guards.pickle_guards_state = without_global_key_orders
    try:
        yield
    finally:
        guards.pickle_guards_state = pickle_guards_state


def _release_guard_manager(error: BaseException | None) -> None:
    """Drops what a guard manager failing to save its guards holds (the traced model and inputs: device
    memory): torch 2.13 raises before releasing them, and a weakref finalizer keeps the manager alive."""
    while error is not None:
        frame = error.__traceback__
        while frame is not None:
            manager = frame.tb_frame.f_locals.get("self")
            if isinstance(manager, torch._dynamo.guards.CheckFunctionManager):
                manager.output_graph = None
                manager._weakrefs.clear()
            frame = frame.tb_next
        error = error.__cause__ or error.__context__


def _importable(cls: type) -> bool:
    found: Any = sys.modules.get(cls.__module__)
    for name in cls.__qualname__.split("."):
        found = getattr(found, name, None)
    return found is cls


def _modes() -> str:
    """The modes a traced graph depends on: grad (a graph traced under `no_grad` has no backward),
    autocast and the default dtype."""
    return f"grad={torch.is_grad_enabled()} {autocast_state()} default={torch.get_default_dtype()}"


def _restore(path: Path, function: Callable[..., Any], modules: dict[str, str], model: torch.nn.Module,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, AOTCompiledFunction | None]:
    """The saved function in `path` (whose code reaches `modules` through the names given), or why
    it must not be used."""
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, TracingContext, compile_context, tracing
    from torch._subclasses import FakeTensorMode

    try:  # (Dynamo's guards are rebuilt inside a compile and tracing context, as `AOTCompiledModel` loads them)
        with (compile_context(CompileContext(convert_frame.get_compile_id({}))), get_metrics_context(),
              tracing(TracingContext(FakeTensorMode()))):
            imported = {name: importlib.import_module(module) for name, module in modules.items()}
            f_globals = {**function.__globals__, **imported}
            compiled = AOTCompiledFunction.deserialize(path.read_bytes(), f_globals=f_globals)
    except Exception as error:  # whatever a damaged or foreign file raises, it is not run
        return f"it does not load ({type(error).__name__}: {first_line(error)})", None
    changed = _changed_source(compiled)
    if changed is not None:
        return f"the source it traced changed since ({changed})", None
    if not compiled.guard_check(model, *args, **kwargs):
        return f"its guards refuse this call ({_refusal(compiled, model, args, kwargs)})", None
    return None, compiled


def _refusal(compiled: AOTCompiledFunction, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> str:
    """The guards of `compiled` that refuse this call (from torch's private API: there is no public one)."""
    failed = compiled._artifacts.guard_manager.check_verbose(compiled.prepare_f_locals(model, *args, **kwargs))
    return "; ".join(failed.verbose_code_parts)[:500]


def _changed_source(compiled: AOTCompiledFunction) -> str | None:
    """The first source Dynamo inlined when tracing `compiled` that is not the same now, or None."""
    from torch._dynamo.package import _get_sourcelines, _hash_source

    for source in compiled.source_info().inlined_sources:
        module = sys.modules.get(source.module)
        try:
            module = module or importlib.import_module(source.module)
            now = _hash_source("".join(_get_sourcelines(module, source.firstlineno, source.lastlineno)))
        except Exception:  # (a module gone or unreadable is a changed source)
            now = None
        if now != source.checksum:
            return f"{source.module}, lines {source.firstlineno}-{source.lastlineno}"
    return None


def _remember_slot(cache: CompileCache, dependencies: dict[str, Any], key: str) -> None:
    """Notes which entry was saved last for this call, to name what changed when it is not used."""
    write_atomically(cache.root / SLOTS_DIR / f"{_slot(dependencies)}.json",
                      json.dumps({"key": key, **dependencies}, sort_keys=True))


def _unsaveable_note(cache: CompileCache, key: str) -> Path:
    return cache.root / SLOTS_DIR / f"{key}.unsaveable"


def _programs_note(cache: CompileCache, key: str) -> Path:
    """Where the programs the function of entry `key` ran on its first call are noted (see `saved`)."""
    return cache.root / SLOTS_DIR / f"{key}.programs.json"


def _explain_miss(cache: CompileCache, dependencies: dict[str, Any]) -> str | None:
    """Why the function saved last for this call does not serve it (the fields that changed), or None."""
    try:
        saved = json.loads((cache.root / SLOTS_DIR / f"{_slot(dependencies)}.json").read_text())
    except (OSError, ValueError):
        return None
    changed = []
    for field, value in dependencies.items():
        if isinstance(value, dict) and isinstance(saved.get(field), dict):
            changed += [f"{field} {name} {saved[field].get(name)!r} -> {now!r}" for name, now in value.items()
                        if saved[field].get(name) != now]
        elif saved.get(field) != value:
            changed.append(f"the {field}")
    return ", ".join(changed) or None


_warned: set[str] = set()


def _warn_miss(changed: str | None, dependencies: dict[str, Any]) -> None:
    """Warns, once per process, function and change, that a saved function was not used because of `changed`."""
    name = dependencies["function"]["name"]
    if changed is not None and f"{name}: {changed}" not in _warned:
        _warned.add(f"{name}: {changed}")
        warnings.warn(f"A compiled {name} saved for this call was not used: {changed}. "
                      "It is traced and compiled again (and saved for the next start).", stacklevel=4)


def _slot(dependencies: dict[str, Any]) -> str:
    """What a call is, apart from what it depends on: the function, the model's class, the inputs."""
    return _digest([dependencies["function"]["name"], dependencies["model"], dependencies["inputs"]])[:32]


def _source_digest(function: Callable[..., Any]) -> str:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        source = function.__code__.co_code.hex()
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def _describe(value: Any, depth: int = 0) -> Any:
    """A call's arguments as data: tensors by shape, strides, dtype, device and grad; plain values
    by value; containers item by item; other objects (a cache) by class and attributes."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype), value.device.type,
                value.requires_grad]
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *(_describe(item, depth + 1) for item in value)]
    if isinstance(value, dict):
        return {str(name): _describe(item, depth + 1) for name, item in value.items()}
    if depth < 4 and hasattr(value, "__dict__"):
        return {"class": type(value).__qualname__,
                **{name: _describe(item, depth + 1) for name, item in sorted(vars(value).items())}}
    return type(value).__qualname__
