"""Building a folder that other processes may build at the same time: in a private staging folder,
then renamed into place under a lock, so that readers never see a half-built folder, concurrent
builders build once, and an interrupted or failed build leaves nothing that blocks a retry."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def build_once(final: Path, build: Callable[[Path], None], *, lock: Path, staging_parent: Path,
               is_complete: Callable[[Path], bool] = Path.is_dir) -> bool:
    """Makes `final` exist, built by `build(folder)` into a fresh staging folder unless it is
    complete already (`is_complete(final)`), by this process or another one.

    Args:
        final: the folder to make.
        build: fills the (empty, existing) staging folder it is given.
        lock: the lock file that serializes builders of `final`.
        staging_parent: where staging folders go; on the same file system as `final`, so that the
            rename is atomic.
        is_complete: whether a folder found at `final` is complete (default: it exists); an
            incomplete one (left by hand) is replaced.

    Returns:
        Whether this call built it.

    Raises:
        Whatever `build` raises; the staging folder is removed and `final` is left as it was.
    """
    if is_complete(final):
        return False
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if is_complete(final):  # another process built it while we waited
            return False
        staging = staging_parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            build(staging)
            shutil.rmtree(final, ignore_errors=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True
