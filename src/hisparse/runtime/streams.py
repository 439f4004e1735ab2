"""Copy stream and per-layer ready events, with a no-op stand-in on the CPU.

On CUDA the swap-in runs on a side stream so it overlaps the compute of earlier layers; each
layer's attention waits only on its own event. On the CPU everything runs in program order,
which is what the no-op versions express, so the runtime has one code path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class CopyStream:
    """The side stream swap-ins run on (`None` stream on the CPU)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self.stream = stream
        if stream is None and device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)

    def wait_for_compute(self) -> None:
        """Order everything queued on the compute stream so far before later copies."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_waits_for_copies(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def new_event(self) -> LayerEvent:
        return LayerEvent(self)


class LayerEvent:
    """ "This layer's rows are on the GPU": recorded on the copy stream, awaited by compute."""

    def __init__(self, copy: CopyStream) -> None:
        self._copy = copy
        self._event = torch.cuda.Event() if copy.stream is not None else None

    def record(self) -> None:
        if self._event is not None:
            self._event.record(self._copy.stream)

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._copy.device).wait_event(self._event)
