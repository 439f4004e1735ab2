"""Step hooks for the tensor-parallel tests: what each rank selected, as one digest."""

from __future__ import annotations

import zlib

import torch

from hisparse.engine.hooks import StepHooks, StepRequests


class SelectionDigest(StepHooks):
    """A running CRC-32 of every decode top-k every index-group leader used (the engine's
    `tp_follower.rank_state` reports ``digest``: equal on every rank when every rank selected
    the same rows bit for bit). Changes nothing."""

    def __init__(self) -> None:
        self.digest = 0
        self.selections = 0

    def decode_topk(self, leader: int, topk: torch.Tensor, reqs: StepRequests) -> torch.Tensor:
        data = topk.detach().contiguous().cpu().numpy()
        self.digest = zlib.crc32(data, zlib.crc32(bytes([leader]), self.digest))
        self.selections += 1
        return topk
