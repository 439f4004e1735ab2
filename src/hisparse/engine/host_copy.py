"""Host values (Python lists) copied to the device without waiting for it.

A plain ``torch.tensor(values).to(cuda)`` copies from pageable memory, which makes the host
wait until the stream has finished everything queued before (PyTorch synchronizes after such
a copy). With async scheduling a decode step is on the GPU while the host prepares the next
one, so such a copy would stall the host for a whole step. Through pinned memory the copy is
queued on the stream instead (PyTorch's pinned-memory cache keeps the buffer until the copy
has run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def host_tensor(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a host tensor to copy to ``device`` with ``non_blocking=True``: pinned
    where ``device`` is CUDA."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``, the copy queued on the current stream (not waited for)."""
    return host_tensor(values, dtype, device).to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, the copy queued (pinned first where ``device`` is CUDA)."""
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)
