"""The package's layout: each concept in one place, and imports that run downward through the
layers README.md lists (a newcomer reads the package top to bottom)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import optimum_neuron_torch

PACKAGE = Path(optimum_neuron_torch.__file__).parent
# The layers, lowest first: a module may import from its own layer's modules listed before it and
# from lower layers only (README.md, "Layout").
LAYERS = [
    ["version", "errors", "host", "settings", "object_collectives", "staging", "module_stack"],
    ["device"],
    ["compiler"],
    ["loading"],
    ["fallbacks", "patches"],
    ["generation", "training"],
    ["modeling"],
    ["compatibility", "pipelines", "serving"],
    ["commands"],
    ["__init__"],
]


def _imports(path: Path) -> list[tuple[str | None, int, list[str]]]:
    """(module, level, names) of every `from ... import ...` in a file."""
    tree = ast.parse(path.read_text())
    return [(node.module, node.level, [alias.name for alias in node.names])
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]


def _absolute(path: Path, module: str | None, level: int) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    base = parts[: len(parts) - level] if level else []
    return ".".join(base + ([module] if module else []))


def _touches_the_environment(path: Path) -> bool:
    """Whether the code of `path` (not its docstrings or comments) uses `os.environ` or `os.getenv`."""
    return any(isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
               and isinstance(node.value, ast.Name) and node.value.id == "os"
               for node in ast.walk(ast.parse(path.read_text())))


def test_environment_variables_are_read_in_the_settings_module_only():
    users = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _touches_the_environment(path))
    # Besides settings.py, two modules set a variable for another program, and read nothing else:
    # compiler/artifact.py, Inductor's cache folder around a compile (restored after); commands/launch.py,
    # torch's launcher's shutdown timeout for a server's drain.
    assert users == ["commands/launch.py", "compiler/artifact.py", "settings.py"]


def test_no_module_imports_the_package_top_or_the_reference_devices_internals():
    for path in PACKAGE.rglob("*.py"):
        for module, level, names in _imports(path):
            if level == 0 and not (module or "").startswith("optimum_neuron_torch"):
                continue
            target = _absolute(path, module, level) if level else module
            where = f"{path.relative_to(PACKAGE)} imports {names} from {target}"
            if target == "optimum_neuron_torch" and path != PACKAGE / "__init__.py":  # submodules only
                assert all((PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file() for name in names), where
            if PACKAGE / "device" / "reference" in path.parents:
                continue
            reached = [target, *(f"{target}.{name}" for name in names)]
            internal = [name for name in reached if name.startswith("optimum_neuron_torch.device.reference")]
            # Only the device layer itself uses the reference device, and only through its package API.
            assert not internal or (path.parent == PACKAGE / "device"
                                    and internal == ["optimum_neuron_torch.device.reference"]), where


def _rank(name: str) -> tuple[int, int]:
    return next((layer, LAYERS[layer].index(name)) for layer in range(len(LAYERS)) if name in LAYERS[layer])


def test_imports_run_downward_through_the_layers():
    tops = {path.name.removesuffix(".py") for path in PACKAGE.iterdir()
            if path.suffix == ".py" or (path / "__init__.py").is_file()}
    assert tops == {name for layer in LAYERS for name in layer}  # a new top-level module gets a layer
    for path in PACKAGE.rglob("*.py"):
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module, level, names in _imports(path):
            target = _absolute(path, module, level) if level else module or ""
            if not target.startswith("optimum_neuron_torch"):
                continue
            parts = target.split(".")[1:]
            for imported in parts[:1] or names:
                if imported == source:
                    continue
                below = _rank(imported) < _rank(source) and (
                    _rank(imported)[0] < _rank(source)[0] or LAYERS[_rank(source)[0]] == LAYERS[0])
                assert below, f"{path.relative_to(PACKAGE)} imports {imported}, which is not below {source}"


# Where the backend is chosen (`device/selection.py`) and the one object that answers what differs
# between TorchNeuron and the reference device (`device/backends.py`).
BACKEND_HOMES = {"device/selection.py", "device/backends.py"}
BACKEND_NAMES = {"torchneuron", "reference"}


def _compares_a_backend_name(node: ast.AST) -> bool:
    """A comparison (`==`, `!=`, `in`, ...) with the string `"torchneuron"` or `"reference"` on
    either side, or inside a tuple, list or set compared with."""
    if not isinstance(node, ast.Compare):
        return False
    for operand in (node.left, *node.comparators):
        strings = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        if any(isinstance(value, ast.Constant) and value.value in BACKEND_NAMES for value in strings):
            return True
    return False


def test_no_module_asks_which_backend_by_its_name():
    # (the package, and what users copy from: the examples and benchmarks; the tests check the names)
    paths = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "examples").rglob("*.py"),
             *(PACKAGE.parent / "benchmarks").rglob("*.py")]
    homes = {PACKAGE / home for home in BACKEND_HOMES}
    comparisons = sorted(
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in paths if path not in homes
        for node in ast.walk(ast.parse(path.read_text())) if _compares_a_backend_name(node)
    )
    assert comparisons == [], "ask `backend_info()`'s attributes (device/backends.py), not its name"


def test_every_public_export_documents_its_arguments_and_an_example():
    undocumented = []
    for name in optimum_neuron_torch.__all__:
        obj = getattr(optimum_neuron_torch, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        doc = inspect.getdoc(obj) or ""
        parameters = [parameter for parameter in inspect.signature(obj).parameters
                      if parameter not in ("self", "args", "kwargs")]
        missing = [section for section, needed in (("Args:", bool(parameters)), ("Example", True))
                   if needed and section not in doc]
        if missing:
            undocumented.append(f"{name}: {', '.join(missing)}")
    assert undocumented == []
