"""Which implementation a dispatch point uses: the Triton kernel on CUDA, the reference
elsewhere, unless an environment variable (``HISPARSE_ATTENTION``, ``HISPARSE_INDEXER``) forces
one for A/B checks and debugging."""

from __future__ import annotations

import os

import torch


def env_backend(var: str, device: torch.device) -> str:
    """``triton`` or ``reference`` for tensors on ``device``, as ``var`` decides."""
    choice = os.environ.get(var, "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"{var}={choice!r}: use 'auto', 'reference' or 'triton'.")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return choice
