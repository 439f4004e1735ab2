"""What one forward step tells the HiSparse runtime, built once per step by the model runner.

`StepMetadata` is shared by every sparse layer; `GroupTables` by the layers of one
resident/hot group (a block id belongs to one group of the shared GPU pool, so each group has
its own block tables). All tensors live on the runtime's device and keep fixed shapes across
steps of one batch size, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepMetadata:
    """Per-step inputs common to every sparse layer.

    Attributes:
        num_tokens: query rows in this step (padding included).
        is_decode: every request brings at most ``max_query_len`` rows (decode or speculative
            verification); otherwise a prefill (chunk) step.
        req_per_token: ``[T]`` int32 batch index of each query row (``< 0``: padding).
        request_state_indices: ``[Q]`` int32 hot-state slot of each request (``< 0``: padding).
        source_block_table: ``[Q, NB]`` int32 host block ids (0 = none).
        host_slot_mapping: ``[T]`` int32 host row each new token's KV row is mirrored to
            (``-1``: nothing to write), or ``None`` in all-GPU placement.
        all_resident: a decode step whose requests hold every page resident (HiSparse with
            ``offload="under_pressure"`` while the pool has room): every row the top-k names
            is on a resident page, so on CUDA the leader looks the rows up in the resident
            table as the all-GPU placement does (what a resolve finds there, without its hot
            state, swap lists and counters); the host mirror still runs.
    """

    num_tokens: int
    is_decode: bool
    req_per_token: torch.Tensor
    request_state_indices: torch.Tensor
    source_block_table: torch.Tensor
    host_slot_mapping: torch.Tensor | None = None
    all_resident: bool = False

    @property
    def num_reqs(self) -> int:
        return self.request_state_indices.shape[0]


@dataclass
class GroupTables:
    """Per-step block tables of one resident/hot group.

    Attributes:
        resident_block_table: ``[Q, NB]`` int32 GPU block of each resident page (0: on host
            only). In all-GPU placement every page is resident.
        slot_mapping: ``[T]`` int32 resident physical row each new token is written to
            (``-1``: padding).
    """

    resident_block_table: torch.Tensor
    slot_mapping: torch.Tensor
