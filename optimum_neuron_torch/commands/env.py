"""`optimum-cli neuron-torch env`: what a bug report needs first: the backend, versions, CPU,
devices, support profile, fallback policy, cache folders and the relevant environment variables."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from ..compiler.cache import cache_root, torchneuron_neff_cache
from ..device import backend_info
from ..device.reference.settings import cache_dir
from ..fallbacks import get_fallback_policy

PACKAGES = ("optimum-neuron-torch", "torch", "transformers", "optimum", "huggingface_hub", "torch-mlir")
VARIABLE_PREFIXES = ("OPTIMUM_NEURON_TORCH_", "TORCH_NEURONX_", "NEURON_")
VARIABLES = ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_OFFLINE",
             "XDG_CACHE_HOME", "CXX", "OMP_NUM_THREADS")


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _cpu() -> str:
    """The CPU's model name, its cores and the vector ISA compiled kernels use."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), {torch.backends.cpu.get_cpu_capability()}"


def environment() -> dict[str, Any]:
    """The report, as plain data (what `--format json` prints)."""
    info = backend_info()
    caches = {"library": str(cache_dir()), "compile": str(cache_root())}
    if info.name == "torchneuron":
        caches["torchneuron_neff"] = str(torchneuron_neff_cache())
    return {
        "backend": {"name": info.name, "version": info.version},
        "versions": {**{package: _version(package) for package in PACKAGES}, "python": platform.python_version()},
        "platform": platform.platform(),
        "cpu": _cpu(),
        "devices": [
            {"index": index, "name": torch.neuron.get_device_name(index),
             "memory_bytes": torch.neuron.get_device_properties(index).total_memory}
            for index in range(torch.neuron.device_count())
        ],
        "profile": info.profile,
        "fallback_policy": get_fallback_policy(),
        "caches": caches,
        "environment_variables": {
            name: value for name, value in sorted(os.environ.items()) if name.startswith(VARIABLE_PREFIXES) or name in VARIABLES
        },
    }


def render_text(report: dict[str, Any]) -> str:
    """The report as lines of `name: value`, to paste into a bug report."""
    lines = [f"backend: {report['backend']['name']} {report['backend']['version']}"]
    lines += [f"{package}: {package_version}" for package, package_version in report["versions"].items()]
    lines += [f"platform: {report['platform']}", f"cpu: {report['cpu']}", f"devices: {len(report['devices'])}"]
    lines += [f"  neuron:{device['index']}: {device['name']}, {device['memory_bytes'] / 2**30:.2f} GiB" for device in report["devices"]]
    lines += [f"support profile: {report['profile']}", f"fallback policy: {report['fallback_policy']}"]
    lines += [f"{name.replace('_', ' ')} cache: {path}" for name, path in report["caches"].items()]
    variables = report["environment_variables"]
    lines.append("environment variables:" if variables else "environment variables: none set")
    lines += [f"  {name}={value}" for name, value in variables.items()]
    return "\n".join(lines)


def print_environment(format: str = "text") -> None:
    """Prints the report as text or JSON."""
    report = environment()
    print(json.dumps(report, indent=2) if format == "json" else render_text(report))
