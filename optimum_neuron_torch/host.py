"""Facts about the host machine that builds and keys depend on: its available memory and its C++
compiler (nothing here starts a device)."""

from __future__ import annotations

import os
import subprocess

from .errors import ReferenceDeviceBuildError


def available_memory() -> int | None:
    """Physical memory the host can give, from /proc/meminfo or sysconf; None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version` (the reference device and Inductor's kernels are
    built with it, so it is part of their cache keys).

    Raises:
        ReferenceDeviceBuildError: the compiler does not run.
    """
    try:
        output = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise ReferenceDeviceBuildError(f"the C++ compiler {compiler!r} does not run: {error}") from error
    return output.splitlines()[0] if output else compiler
