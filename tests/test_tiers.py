"""The test tiers (tests/conftest.py): the fast tier, what `python -m pytest` runs, still calls every
public function of the package and every CLI command; the slow tier only adds sizes and cases."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import optimum_neuron_torch

TESTS = Path(__file__).parent
PACKAGE = Path(optimum_neuron_torch.__file__).parent
# The programs the tests run in subprocesses (a rank each, or a training job), by module name.
PROGRAMS = ("distributed_programs", "tensor_parallel_programs", "training_programs")
COMMANDS = ("generate", "check", "compile", "serve", "cache", "list", "stats", "clear", "push", "pull", "env")


def _is_slow(decorators: list[ast.expr]) -> bool:
    """Whether one of the decorators (or `pytestmark` values) is `pytest.mark.slow`."""
    for decorator in decorators:
        for node in ast.walk(decorator):
            if isinstance(node, ast.Attribute) and node.attr == "slow":
                return True
    return False


def _used_names(node: ast.AST) -> set[str]:
    """The identifiers, attribute names and string constants (and their words) in `node`."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.alias):
            found.add(child.asname or child.name.split(".")[-1])
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
            found.update(child.value.replace("(", " ").replace(".", " ").split())
    return found


def fast_tier_names(folder: Path = TESTS) -> set[str]:
    """Every name the fast tier's tests in `folder` use: in each test file, the tests not marked
    slow, the module-level code (imports, constants), and the helpers and fixtures those tests
    reach; the programs run in subprocesses when a fast test names their module."""
    used: set[str] = set()
    for path in sorted(folder.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        marks = [node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(target, "id", "") == "pytestmark" for target in node.targets)]
        if _is_slow(marks):
            continue
        functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        reached = [node for name, node in functions.items()
                   if name.startswith(("test_", "Test")) and not _is_slow(node.decorator_list)]
        seen = {node.name for node in reached}
        file_used = set().union(*(_used_names(node) for node in tree.body if node.__class__ not in
                                  (ast.FunctionDef, ast.ClassDef)))
        while reached:
            names = _used_names(reached.pop())
            file_used |= names
            for name in names & functions.keys() - seen:  # a helper or fixture a fast test reaches
                seen.add(name)
                reached.append(functions[name])
        used |= file_used
    for program in PROGRAMS:
        if program in used and (folder / f"{program}.py").is_file():
            used |= _used_names(ast.parse((folder / f"{program}.py").read_text()))
    return used


def public_functions() -> dict[str, list[str]]:
    """{module: the functions (and other values but classes) of its `__all__`} for the package and
    each of its subpackages. (A class is used through its objects: `check()` returns a report.)"""
    found = {}
    for name in ["optimum_neuron_torch"] + [f"optimum_neuron_torch.{path.parent.name}"
                                            for path in sorted(PACKAGE.glob("*/__init__.py"))]:
        module = importlib.import_module(name)
        found[name] = [public for public in getattr(module, "__all__", [])
                       if not isinstance(getattr(module, public), type) and not public.startswith("__")]
    return found


def test_the_fast_tier_calls_every_public_function_and_command():
    used = fast_tier_names()
    missing = [f"{module}.{name}" for module, names in public_functions().items() for name in names
               if name not in used]
    assert missing == [], f"public functions no fast test uses (a slow test's only): {missing}"
    assert [command for command in COMMANDS if command not in used] == []


def test_the_analysis_tells_slow_tests_from_fast_ones(tmp_path):
    """The check above would pass vacuously if it counted slow tests as fast."""
    (tmp_path / "test_one.py").write_text(
        "import pytest\n"
        "@pytest.mark.slow\ndef test_a(fixture_of_slow):\n    only_in_slow_test()\n"
        "def test_b():\n    helper()\n"
        "def helper():\n    reached_by_helper('distributed_programs')\n"
        "def fixture_of_slow():\n    only_in_slow_fixture()\n"
    )
    (tmp_path / "test_two.py").write_text(
        "import pytest\npytestmark = pytest.mark.slow\ndef test_c():\n    in_slow_file()\n")
    (tmp_path / "distributed_programs.py").write_text("def program():\n    run_by_a_fast_test()\n")
    used = fast_tier_names(tmp_path)
    assert {"helper", "reached_by_helper", "run_by_a_fast_test"} <= used
    assert not {"only_in_slow_test", "only_in_slow_fixture", "in_slow_file"} & used
