"""A validated, memory-mapped view of one safetensors file.

The header is checked in full before any byte of data is used (dtype names, shapes, offsets
inside the file, no duplicate or overlapping tensors), so a bad file is refused with an error
that names it and the tensor at fault. Tensors are then read zero-copy from the mapping, and
`release()` drops a tensor's pages from this process once it has been copied to the device, so
host memory in flight stays bounded by the tensor being copied, not by the file.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, CheckpointNotFoundError

HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}

# Linux 5.14+: fault a whole range in at once (large reads) instead of page by page.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

_CORRUPT = "the file is truncated or corrupted: download it again or re-save the checkpoint"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _no_duplicates(path: Path):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise CheckpointError(f"the header names the tensor twice; {_CORRUPT}", file=str(path), tensor=key)
            seen.add(key)
        return dict(pairs)

    return hook


def _entry(path: Path, name: str, info: object, data_start: int, file_size: int) -> TensorEntry:
    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"{problem}; {_CORRUPT}", file=str(path), tensor=name)

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise fail("the header entry lacks dtype, shape or data_offsets")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(
            f"unknown dtype {info['dtype']!r}; this loader reads {', '.join(DTYPES)}", file=str(path), tensor=name
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise fail(f"invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise fail(f"invalid data_offsets {offsets!r}")
    begin, end = offsets
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * dtype.itemsize
    if not 0 <= begin <= end or end - begin != expected:
        raise fail(f"data_offsets {offsets} span {end - begin} bytes but shape {shape} of {info['dtype']} "
                   f"needs {expected}")
    if data_start + end > file_size:
        raise fail(f"the tensor's bytes end at {data_start + end}, past the end of the file ({file_size} bytes)")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


class SafetensorsFile:
    """One safetensors file, header validated, data memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as error:
            missing = isinstance(error, FileNotFoundError)
            raise (CheckpointNotFoundError if missing else CheckpointError)(
                f"cannot open the file: {error.strerror}", file=str(self.path)
            ) from error
        try:
            self.entries = self._read_header()
            size = os.fstat(self._file.fileno()).st_size
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> dict[str, TensorEntry]:
        file_size = os.fstat(self._file.fileno()).st_size
        prefix = self._file.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise CheckpointError(f"the file has {file_size} bytes, fewer than a safetensors header; {_CORRUPT}",
                                  file=str(self.path))
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + length > file_size:
            raise CheckpointError(
                f"the header claims {length} bytes but the file has {file_size}; {_CORRUPT}", file=str(self.path)
            )
        try:
            header = json.loads(self._file.read(length), object_pairs_hook=_no_duplicates(self.path))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"the header is not valid JSON ({error}); {_CORRUPT}",
                                  file=str(self.path)) from error
        if not isinstance(header, dict):
            raise CheckpointError(f"the header is not a JSON object; {_CORRUPT}", file=str(self.path))
        header.pop("__metadata__", None)
        data_start = HEADER_LENGTH_BYTES + length
        entries = {name: _entry(self.path, name, info, data_start, file_size) for name, info in header.items()}
        ordered = sorted(entries.values(), key=lambda e: (e.start, e.end))
        for previous, current in zip(ordered, ordered[1:], strict=False):
            if current.start < previous.end and current.nbytes and previous.nbytes:
                raise CheckpointError(
                    f"its bytes overlap those of tensor {previous.name!r}; {_CORRUPT}",
                    file=str(self.path), tensor=current.name
                )
        return entries

    def tensor(self, name: str, part: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """A CPU view of the tensor's bytes in the (copy-on-write) mapping: no copy is made.

        With `part`, a function of the whole tensor's view that returns a view of a piece of it
        (a rank's rows or columns), that piece, and only the pages it spans are read."""
        entry = self.entries[name]
        if entry.nbytes == 0:
            whole = torch.empty(entry.shape, dtype=entry.dtype)
            return whole if part is None else part(whole)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)
        whole = flat.view(entry.dtype).view(entry.shape)
        piece = whole if part is None else part(whole)
        first = piece.data_ptr() - flat.data_ptr()
        if piece.numel() and 0 <= first < entry.nbytes:  # (a piece gathered from several slices is a copy)
            span = (1 + sum((size - 1) * stride for size, stride in zip(piece.shape, piece.stride(), strict=True)))
            start = entry.start + first
            aligned = start - start % mmap.PAGESIZE
            try:  # map the piece's pages in one request rather than fault them in one by one
                self._map.madvise(MADV_POPULATE_READ, aligned, start + span * piece.element_size() - aligned)
            except OSError:
                pass  # an older kernel: the copy faults the pages in, correctly, if more slowly
        return piece

    def prefetch(self) -> None:
        """Starts reading the whole file into the page cache in the background (kernel readahead;
        the page cache is not this process's memory), so the disk works while tensors are copied."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_WILLNEED)

    def release(self, name: str) -> None:
        """Drops the pages of a tensor already copied out, so they stop counting in this process."""
        entry = self.entries[name]
        if self._map is not None and entry.nbytes:
            self._map.madvise(mmap.MADV_DONTNEED, *self._pages(entry))

    @staticmethod
    def _pages(entry: TensorEntry) -> tuple[int, int]:
        """(start, length) of the page-aligned range holding a tensor."""
        start = entry.start - entry.start % mmap.PAGESIZE
        return start, entry.end - start

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
