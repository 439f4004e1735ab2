"""How a DSA attention layer reaches its caches: a small protocol, and a dense implementation.

Per layer and step the attention (docs/design.md §5):

1. packs this step's new KV rows in the row format and writes them at the physical slots of
   ``write_target()`` (a paged ``uint8 [num_blocks, block_size, row_bytes]`` view), then calls
   ``finish_kv_update()`` (HiSparse mirrors them to the host and drops stale hot copies);
2. on a full-indexer layer, writes the indexer keys into the indexer pages and scores every
   earlier key of the request (read through the indexer block table) -> logical top-k;
3. turns the logical top-k into physical rows with ``swap_in()`` (HiSparse: resident rows or
   hot rows it just gathered; dense cache: a block-table lookup);
4. runs sparse attention on the view of step 1 at those physical rows (``-1`` masked).

`hisparse.runtime.cache_handle.CacheHandle` already has the three methods of
`SparseMlaLayerCache`; the engine supplies it together with an indexer-page view per layer.
`DenseDsaCache` is the all-in-one-tensor implementation for tests and CPU use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hisparse.kv.row_formats import IndexerCacheFormat, MlaFormat, mla_row_bytes
from hisparse.models.dsa_config import DsaConfig


@dataclass
class ForwardStep:
    """Token-level metadata of one forward step (packed, variable-length batch).

    Attributes:
        positions: ``[N]`` int64 position of each token within its request.
        req_index: ``[N]`` int64 request row of each token (``< 0``: padding).
        seq_lens: ``[R]`` int64 tokens each request holds after this step (its key count).
        max_len: keys the indexer scores at most, known on the host (spares it a device read
            of ``seq_lens``); ``None``: it reads the longest request (or, under CUDA-graph
            capture, scores the whole block table).
        verify: a decode step whose requests bring their last token and its drafts, several
            consecutive rows each (speculative decoding's verification).
        static: a fixed-shape step that must not read the device from the host (padded
            decode batches, CUDA-graph capture): the MoE takes its sync-free form.
    """

    positions: torch.Tensor
    req_index: torch.Tensor
    seq_lens: torch.Tensor
    max_len: int | None = None
    static: bool = False
    verify: bool = False

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


@runtime_checkable
class SparseMlaLayerCache(Protocol):
    """One layer's MLA rows (the methods `CacheHandle` provides)."""

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(paged uint8 view ``[NB, BS, row_bytes]``, physical slot of each new token ``[N]``)."""
        ...

    def finish_kv_update(self) -> None:
        """Called once the step's rows are written."""
        ...

    def swap_in(self, logical_topk: torch.Tensor) -> torch.Tensor:
        """Physical rows of the write-target view for logical positions ``[N, K]`` (-1 kept)."""
        ...


@runtime_checkable
class IndexerLayerCache(Protocol):
    """One full-indexer layer's key pages (``[NB, BS * row_bytes]`` uint8, always on the GPU)."""

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, physical slot of each new token ``[N]``)."""
        ...

    def read_source(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, block table ``[R, max_blocks]`` int32 of each request of the step)."""
        ...


@runtime_checkable
class DsaKVCache(Protocol):
    """The model-level view: row formats plus per-layer caches."""

    @property
    def row_format(self) -> MlaFormat: ...

    @property
    def indexer_format(self) -> IndexerCacheFormat: ...

    def attention(self, layer: int) -> SparseMlaLayerCache: ...

    def indexer(self, layer: int) -> IndexerLayerCache: ...


class DenseBlockTables:
    """Block tables of a fixed set of request slots, each owning its own range of blocks.

    Request ``r`` owns blocks ``1 + r * MB .. (r + 1) * MB`` (block 0 is the null block, as in
    the engine's pools), so physical row = ``table[r, p // BS] * BS + p % BS``. Call
    `begin_step` before each forward with the requests of the batch and their new token counts.
    The dense caches of every model family share this (`DenseDsaCache`, the Llama
    `hisparse.models.llama.DenseGqaCache`); each adds the per-layer tensors it addresses:
    ``kv`` (paged rows of each layer) and ``index_pages`` (indexer pages by layer).
    """

    kv: list[torch.Tensor]
    index_pages: dict[int, torch.Tensor]

    def __init__(
        self,
        *,
        max_reqs: int,
        max_len: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        self.device = torch.device(device)
        self.num_blocks = 1 + max_reqs * self.max_blocks
        self.block_table = (
            1 + torch.arange(max_reqs * self.max_blocks, dtype=torch.int32, device=self.device)
        ).view(max_reqs, self.max_blocks)
        self.lens = [0] * max_reqs
        self.max_len = max_len
        self._slots: torch.Tensor | None = None
        self._tables: torch.Tensor | None = None
        self._req_of_token: torch.Tensor | None = None

    def reset(self, req: int) -> None:
        """Forget request ``req`` (its slots are rewritten by the next request using them)."""
        self.lens[req] = 0

    def begin_step(self, reqs: Sequence[int], num_new: Sequence[int]) -> ForwardStep:
        """Append ``num_new[i]`` tokens to request ``reqs[i]``; metadata for the forward."""
        step = append_tokens(self.lens, self.max_len, reqs, num_new, self.device)
        self._tables = self.block_table[torch.tensor(list(reqs), device=self.device)]
        self._slots = self._physical(step.req_index, step.positions)
        self._req_of_token = step.req_index
        return step

    def _physical(self, req_row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert self._tables is not None
        bs = self.block_size
        blk = self._tables[req_row.clamp(min=0), (pos.clamp(min=0) // bs)].long()
        rows = blk * bs + pos.clamp(min=0) % bs
        return torch.where((pos >= 0) & (req_row >= 0), rows, torch.full_like(rows, -1))

    def _step_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._slots is None or self._tables is None or self._req_of_token is None:
            raise RuntimeError(f"{type(self).__name__}.begin_step was not called")
        return self._slots, self._tables, self._req_of_token

    def attention(self, layer: int) -> _DenseAttentionLayer:
        return _DenseAttentionLayer(self, layer)

    def indexer(self, layer: int) -> _DenseIndexerLayer:
        if layer not in self.index_pages:
            raise KeyError(f"layer {layer} has no indexer of its own (e.g. IndexShare follower)")
        return _DenseIndexerLayer(self, layer)


class DenseDsaCache(DenseBlockTables):
    """Every row of every request in plain tensors on one device (no host tier, no eviction).

    Block tables and step metadata come from `DenseBlockTables`.
    """

    def __init__(
        self,
        config: DsaConfig,
        *,
        max_reqs: int,
        max_len: int,
        block_size: int = 64,
        row_format: MlaFormat = "fp32",
        indexer_format: IndexerCacheFormat | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(max_reqs=max_reqs, max_len=max_len, block_size=block_size, device=device)
        self.config = config
        self._row_format = row_format
        self._indexer_format = indexer_format or IndexerCacheFormat.for_mode(
            "exact", config.index_head_dim
        )
        row_bytes = mla_row_bytes(row_format, config.kv_lora_rank, config.qk_rope_head_dim)
        self.kv = [
            torch.zeros(
                self.num_blocks, block_size, row_bytes, dtype=torch.uint8, device=self.device
            )
            for _ in range(config.num_hidden_layers)
        ]
        page = self._indexer_format.page_bytes(block_size)
        self.index_pages = {
            i: torch.zeros(self.num_blocks, page, dtype=torch.uint8, device=self.device)
            for i, full in enumerate(config.indexer_full)
            if full
        }

    @property
    def row_format(self) -> MlaFormat:
        return self._row_format

    @property
    def indexer_format(self) -> IndexerCacheFormat:
        return self._indexer_format


class _DenseAttentionLayer:
    def __init__(self, cache: DenseBlockTables, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots, _, _ = self.cache._step_state()
        return self.cache.kv[self.layer], slots

    def finish_kv_update(self) -> None:
        """Nothing to mirror: every row already lives in its only tier."""

    def swap_in(self, logical_topk: torch.Tensor) -> torch.Tensor:
        _, _, req = self.cache._step_state()
        n, k = logical_topk.shape
        pos = logical_topk.long()
        phys = self.cache._physical(req[:n, None].expand(n, k), pos)
        return phys.to(torch.int32)


class _DenseIndexerLayer:
    def __init__(self, cache: DenseBlockTables, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots, _, _ = self.cache._step_state()
        return self.cache.index_pages[self.layer], slots

    def read_source(self) -> tuple[torch.Tensor, torch.Tensor]:
        _, tables, _ = self.cache._step_state()
        return self.cache.index_pages[self.layer], tables


def append_tokens(
    lens: list[int],
    max_len: int,
    reqs: Sequence[int],
    num_new: Sequence[int],
    device: torch.device,
    with_max_len: bool = False,
) -> ForwardStep:
    """Append ``num_new[i]`` tokens to request slot ``reqs[i]`` of ``lens`` (each at most
    ``max_len``): the step's metadata, as the dense test caches' ``begin_step`` build it
    (``with_max_len``: the step's host bound on keys set too)."""
    if len(reqs) != len(num_new) or len(set(reqs)) != len(reqs):
        raise ValueError("reqs must be distinct and match num_new")
    positions, req_index, seq_lens = [], [], []
    for row, (r, n) in enumerate(zip(reqs, num_new, strict=True)):
        start = lens[r]
        if start + n > max_len:
            raise ValueError(f"request {r} would hold {start + n} > max_len={max_len}")
        positions.append(torch.arange(start, start + n))
        req_index.append(torch.full((n,), row))
        seq_lens.append(start + n)
        lens[r] = start + n
    return ForwardStep(
        positions=torch.cat(positions).to(device),
        req_index=torch.cat(req_index).to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        max_len=max(seq_lens) if with_max_len else None,
    )
