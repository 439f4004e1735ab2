"""Tensor parallelism over torch.distributed (docs/design.md §18).

`LLM(..., tensor_parallel_size=N)` runs one rank per GPU (the CPU: one process per rank,
gloo): rank 0 drives, the others follow its commands (`group`); each rank holds its shard of
the model (`shard`) and the node's ranks share one host pool (`shm`).
"""

from hisparse.parallel.group import TensorParallelError, TPGroup
from hisparse.parallel.shard import check_tensor_parallel_size

__all__ = ["TPGroup", "TensorParallelError", "check_tensor_parallel_size"]
