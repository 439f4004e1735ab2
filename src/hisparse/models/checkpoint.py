"""A safetensors checkpoint read by slices: its tensor index, the memory-mapped reads, progress.

The index comes from the files' JSON headers alone (names, dtypes, shapes, sizes: no tensor
data), so a loader can check a whole checkpoint against the model and plan what each rank
keeps before it reads a byte. `SliceReader` opens each file memory-mapped (``safe_open``) and
returns a rank's slice of a tensor as a view of the mapping (``get_slice``): the loader copies
it straight into the tensor it keeps, so the host never holds more of the checkpoint than the
page cache does. `LoadProgress` shows the bytes read and the rate (``hisparse generate``).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: safetensors dtype names and the torch dtypes they hold
DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; the message names the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, from its file's header."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} lists {f.name}, which does not exist")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    return files


def read_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte length, then the JSON)."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{file} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            return json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file}: unreadable safetensors header ({err})") from None


class CheckpointIndex:
    """Every tensor of a checkpoint folder by name (`TensorInfo`), read from the headers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = checkpoint_files(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, entry in read_header(f).items():
                if name == "__metadata__":
                    continue
                dtype = DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise CheckpointError(f"{name} in {f.name}: unknown dtype {entry['dtype']}")
                self.tensors[name] = TensorInfo(f, dtype, tuple(entry["shape"]))

    @classmethod
    def of_tensors(cls, path: str | Path, tensors: dict[str, TensorInfo]) -> CheckpointIndex:
        """An index of ``tensors`` without files (what a checkpoint would hold: planning)."""
        index = cls.__new__(cls)
        index.path, index.files, index.tensors = Path(path), [], dict(tensors)
        return index

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def get(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)

    def largest_tensor_bytes(self) -> int:
        return max((t.nbytes for t in self.tensors.values()), default=0)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class SliceReader:
    """Memory-mapped reads of tensor slices (`read`), one ``safe_open`` handle per file,
    counting the bytes read for `LoadProgress`. Use as a context manager: the views it returns
    are valid until it closes."""

    def __init__(self, index: CheckpointIndex, progress: LoadProgress | None = None) -> None:
        self.index = index
        self.progress = progress
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def read(self, name: str, index: tuple[Any, ...] = ()) -> torch.Tensor:
        """``tensor[index]`` of checkpoint tensor ``name`` (ints and slices), as a view of the
        file's mapping where safetensors gives one."""
        info = self.index[name]
        handle = self._handles.get(info.file)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(info.file), framework="pt").__enter__()
            self._handles[info.file] = handle
        sl = handle.get_slice(name)
        full = tuple(index) + (slice(None),) * (len(info.shape) - len(index))
        t = sl[full] if info.shape else sl[:]
        self.bytes_read += t.numel() * t.element_size()
        if self.progress is not None:
            self.progress.advance(t.numel() * t.element_size())
        return t


class LoadProgress:
    """A progress bar of the bytes a loader reads, with GB and GB/s (rich), or nothing."""

    def __init__(self, total: int, console: Any = None, what: str = "loading weights") -> None:
        self.total, self.done = total, 0
        self.start = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None
        if console is not None:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=False),
                TransferSpeedColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(what, total=total)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=min(self.done, self.total))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.total)
            self._bar.stop()
            self._bar = None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.done / max(self.elapsed, 1e-9)


#: Where loaders show their progress bar (a rich Console), set by `show_progress`.
_console: Any = None


@contextmanager
def show_progress(console: Any) -> Iterator[None]:
    """Loaders inside this block draw their progress bar on ``console`` (rank 0 only)."""
    global _console
    saved, _console = _console, console
    try:
        yield
    finally:
        _console = saved


def progress_console() -> Any:
    """The console `show_progress` set, or None."""
    return _console
