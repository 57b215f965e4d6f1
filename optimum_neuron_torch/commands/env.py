"""`optimum-cli neuron-torch env`: what a bug report needs first: the backend, versions, CPU,
devices, support profile, fallback policy, cache folders and the relevant environment variables.

TorchNeuron sets defaults of its own variables with `os.environ.setdefault` when it loads (at
`import torch`), so `os.environ` alone cannot tell them from what the user set: the report compares
it with the environment the process started with (`/proc/self/environ`)."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist

from .. import settings
from ..device import Backend, backend_info
from ..fallbacks import get_fallback_policy

PACKAGES = ("optimum-neuron-torch", "torch", "transformers", "optimum", "huggingface_hub", "torch-mlir")


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
    return (f"{name}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), "
            f"{torch.backends.cpu.get_cpu_capability()}")


def _starting_environment() -> dict[str, str] | None:
    """The environment the process started with (Linux), or None where it cannot be read."""
    try:
        raw = open("/proc/self/environ", "rb").read()  # noqa: SIM115 (one read)
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def _variables() -> tuple[dict[str, str], dict[str, str]]:
    """(set by the user, set inside the process: TorchNeuron's defaults), relevant variables only."""
    starting = _starting_environment()
    current = settings.reported_variables()
    if starting is None:
        return current, {}
    user = {name: value for name, value in current.items() if starting.get(name) == value}
    return user, {name: value for name, value in current.items() if name not in user}


def _devices() -> list[dict[str, Any]]:
    devices = []
    for index in range(torch.neuron.device_count()):
        try:  # on TorchNeuron this starts the runtime, which fails while another process holds the cores
            memory: int | str = torch.neuron.get_device_properties(index).total_memory
        except RuntimeError as error:
            memory = f"unknown ({str(error).partition(chr(10))[0]})"
        devices.append({"index": index, "name": torch.neuron.get_device_name(index), "memory_bytes": memory})
    return devices


def _distributed(backend: Backend) -> dict[str, Any]:
    """The `neuron` process-group backend, and this process's place in a launched job (torchrun's
    variables, or the initialized process group's rank and size)."""
    if not (dist.is_available() and "neuron" in dist.Backend.backend_list):
        return {"backend": None, "transport": None, "default_for_neuron_devices": None}
    report: dict[str, Any] = {
        "backend": "neuron",
        "transport": backend.collective_transport,
        "default_for_neuron_devices": dist.Backend.default_device_backend_map.get("neuron"),
    }
    if dist.is_initialized():
        report["rank"], report["world_size"] = dist.get_rank(), dist.get_world_size()
    elif settings.launched():
        report["rank"], report["world_size"] = settings.launcher_rank(), settings.launcher_world_size()
    if settings.launched_locally():
        report["local_rank"] = settings.launcher_local_rank()
        report["local_world_size"] = settings.launcher_local_world_size()
        report["device"] = f"neuron:{torch.neuron.current_device()}"
    return report


def environment_report() -> dict[str, Any]:
    """The report, as plain data (what `--format json` prints)."""
    info = backend_info()
    caches = {"library": str(settings.cache_dir()), "compile": str(settings.compile_cache_dir())}
    user_variables, process_variables = _variables()
    extra: dict[str, Any] = {}
    if info.neff_cache is not None:
        caches["torchneuron_neff"] = str(info.neff_cache)
        extra["neff_cache_variables"] = settings.neff_cache_variables()
    if info.sets_defaults_at_import:  # (told apart from what the user set)
        extra["torchneuron_defaults"] = process_variables
    else:
        user_variables = {**user_variables, **process_variables}
    return {
        "backend": {"name": info.name, "version": info.version},
        "versions": {**{package: _version(package) for package in PACKAGES}, "python": platform.python_version()},
        "platform": platform.platform(),
        "cpu": _cpu(),
        "devices": _devices(),
        "profile": info.profile,
        "fallback_policy": get_fallback_policy(),
        "distributed": _distributed(info),
        "caches": caches,
        "environment_variables": user_variables,
        **extra,
    }


def render_text(report: dict[str, Any]) -> str:
    """The report as lines of `name: value`, to paste into a bug report."""
    lines = [f"backend: {report['backend']['name']} {report['backend']['version']}"]
    lines += [f"{package}: {package_version}" for package, package_version in report["versions"].items()]
    lines += [f"platform: {report['platform']}", f"cpu: {report['cpu']}", f"devices: {len(report['devices'])}"]
    lines += [f"  {device['name']}: {_memory(device['memory_bytes'])}" for device in report["devices"]]
    lines += [f"support profile: {report['profile']}", f"fallback policy: {report['fallback_policy']}"]
    lines.append(_render_distributed(report["distributed"]))
    lines += [f"{name.replace('_', ' ')} cache: {path}" for name, path in report["caches"].items()]
    sections = [("environment variables", report["environment_variables"], "none set")]
    if "torchneuron_defaults" in report:
        sections.append(("set by TorchNeuron at import (its defaults)", report["torchneuron_defaults"], "none"))
        sections.append(("TorchNeuron NEFF cache variables", report["neff_cache_variables"], "none"))
    for title, variables, empty in sections:
        lines.append(f"{title}:" if variables else f"{title}: {empty}")
        lines += [f"  {name}={value}" for name, value in variables.items()]
    return "\n".join(lines)


def _render_distributed(distributed: dict[str, Any]) -> str:
    if distributed["backend"] is None:
        return "distributed backend: none (torch.distributed unavailable)"
    line = f"distributed backend: {distributed['backend']} ({distributed['transport']})"
    if "rank" in distributed:
        line += f", rank {distributed['rank']} of {distributed['world_size']}"
    if "local_rank" in distributed:
        line += (f", local rank {distributed['local_rank']} of {distributed['local_world_size']} "
                 f"on {distributed['device']}")
    return line if "rank" in distributed else line + ", not in a launched job"


def _memory(memory_bytes: int | str) -> str:
    return f"{memory_bytes / 2**30:.2f} GiB" if isinstance(memory_bytes, int) else memory_bytes


def print_environment(format: str = "text") -> None:
    """Prints the report as text or JSON."""
    report = environment_report()
    print(json.dumps(report, indent=2) if format == "json" else render_text(report))
