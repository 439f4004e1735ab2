"""hisparse: hierarchical sparse attention serving.

The whole KV cache lives in pinned host memory; each running request keeps a small LRU-managed
hot buffer on the GPU, and each decode step swaps in only the top-k rows it misses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig
    from hisparse.engine.llm import LLM, GenerationInterrupted
    from hisparse.engine.request import CompletionOutput, RequestOutput
    from hisparse.engine.sampling_params import SamplingParams

#: the public names and their modules, imported on first use: `import hisparse.engine.scheduler`
#: then loads no torch (the scheduler runs without it)
_PUBLIC = {
    "LLM": "hisparse.engine.llm",
    "GenerationInterrupted": "hisparse.engine.llm",
    "CompletionOutput": "hisparse.engine.request",
    "RequestOutput": "hisparse.engine.request",
    "SamplingParams": "hisparse.engine.sampling_params",
    "HiSparseConfig": "hisparse.config",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "GenerationInterrupted",
    "HiSparseConfig",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hisparse' has no attribute {name!r}")
