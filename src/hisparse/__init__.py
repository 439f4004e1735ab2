"""hisparse: hierarchical sparse attention serving.

The whole KV cache lives in pinned host memory; each running request keeps a small LRU-managed
hot buffer on the GPU, and each decode step swaps in only the top-k rows it misses.
"""

from hisparse.config import HiSparseConfig
from hisparse.engine.llm import LLM, GenerationInterrupted
from hisparse.engine.request import CompletionOutput, RequestOutput
from hisparse.engine.sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "GenerationInterrupted",
    "HiSparseConfig",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
