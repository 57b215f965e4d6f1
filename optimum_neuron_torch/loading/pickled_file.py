"""A pickled weights file (`pytorch_model.bin`), read only on explicit opt-in and only with
`torch.load(weights_only=True)`, behind the same interface as `SafetensorsFile`."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError


@dataclass(frozen=True)
class PickledEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # order in the file, for reading in sequence
    nbytes: int


class PickledFile:
    """The tensors of a pickled state dict, memory-mapped by torch.load."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as error:
            raise CheckpointError(f"cannot read the pickled weights with weights_only=True: {error}",
                                  file=str(self.path)) from error
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError("the file does not hold a state dict of tensors", file=str(self.path))
        self._tensors: dict[str, torch.Tensor] = state
        self.entries = {
            name: PickledEntry(name, t.dtype, tuple(t.shape), position, t.numel() * t.element_size())
            for position, (name, t) in enumerate(state.items())
        }

    def tensor(self, name: str, part: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor (mapped by torch.load), or the piece of it `part` selects (see `SafetensorsFile.tensor`)."""
        return self._tensors[name] if part is None else part(self._tensors[name])

    def prefetch(self) -> None:
        """Nothing to do: torch.load maps the file itself."""

    def release(self, name: str) -> None:
        self._tensors.pop(name, None)

    def close(self) -> None:
        self._tensors.clear()

    def __enter__(self) -> PickledFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
