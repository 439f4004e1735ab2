"""What a DeepSeek-V4 layer caches per request, and a dense implementation of it.

Per layer (docs/design.md §20):

* ``window``: every token's shared K=V row (``head_dim`` values); attention reads the last
  ``sliding_window`` of them;
* compressed layers: ``entries.compressor``, one row per closed window of ``compress_rate``
  tokens, and the compressor's carried state ``state.compressor.{kv,gate}``: the projections of
  the last window (the last two for a compressed sparse layer, whose entries overlap the
  previous window), a ring of ``state_ring`` positions. A window closes when its last token
  arrives, in whichever step that is, so chunk boundaries anywhere give the same entries;
* compressed sparse layers also keep the indexer's own entries and state
  (``entries.indexer``, ``state.indexer.*``).

The model addresses every store by (request row of the step, position) through `V4Cache`;
`DenseV4Cache` keeps each store as one ``[max_reqs, length, width]`` tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hisparse.models.kv_access import ForwardStep, append_tokens
from hisparse.models.v4_config import CSA, V4Config


def state_ring(config: V4Config, layer: int) -> int:
    """Positions of compressor state a layer carries: the open window, and the one before it
    on a compressed sparse layer (its entries overlap two windows)."""
    rate = config.compress_rate(layer)
    return 2 * rate if config.layer_types[layer] == CSA else rate


def store_shapes(config: V4Config, max_len: int) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer, store) -> (rows per request, row width)`` of every store of ``config``."""
    d, di = config.head_dim, config.index_head_dim
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for layer, kind in enumerate(config.layer_types):
        shapes[(layer, "window")] = (max_len, d)
        rate = config.compress_rate(layer)
        if not rate:
            continue
        ring = state_ring(config, layer)
        names = [("compressor", d)] + ([("indexer", di)] if kind == CSA else [])
        for name, width in names:
            series = width * (2 if kind == CSA else 1)
            shapes[(layer, f"entries.{name}")] = (max_len // rate, width)
            shapes[(layer, f"state.{name}.kv")] = (ring, series)
            shapes[(layer, f"state.{name}.gate")] = (ring, series)
    return shapes


class V4Cache(Protocol):
    """Row-addressed per-request stores (module docstring)."""

    def write(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Rows ``values [M, width]`` at ``pos [M]`` of the step's request rows ``req_row``."""
        ...

    def read(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``[*pos.shape, width]`` (zeros where ``pos < 0``); ``req_row`` broadcasts."""
        ...


class DenseV4Cache:
    """Every store of every request slot as a plain tensor on one device (tests, CPU)."""

    def __init__(
        self,
        config: V4Config,
        *,
        max_reqs: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.max_len = max_len
        self.device = torch.device(device)
        self.stores = {
            key: torch.zeros(max_reqs, length, width, dtype=dtype, device=self.device)
            for key, (length, width) in store_shapes(config, max_len).items()
        }
        self.lens = [0] * max_reqs
        self._slots: torch.Tensor | None = None

    def reset(self, req: int) -> None:
        """Forget request slot ``req`` (its rows are rewritten by the next request there)."""
        self.lens[req] = 0

    def begin_step(self, reqs: Sequence[int], num_new: Sequence[int]) -> ForwardStep:
        """Append ``num_new[i]`` tokens to request slot ``reqs[i]``; the step's metadata."""
        step = append_tokens(self.lens, self.max_len, reqs, num_new, self.device, True)
        self._slots = torch.tensor(list(reqs), device=self.device)
        return step

    def _slot(self, req_row: torch.Tensor) -> torch.Tensor:
        if self._slots is None:
            raise RuntimeError("DenseV4Cache.begin_step was not called")
        return self._slots[req_row.long()]

    def write(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor, values: torch.Tensor
    ) -> None:
        t = self.stores[(layer, store)]
        keep = pos >= 0  # pos -1: a row not to write (a fixed-shape step's non-closing window)
        t[self._slot(req_row[keep]), pos[keep].long()] = values[keep].to(t.dtype)

    def read(
        self, layer: int, store: str, req_row: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        t = self.stores[(layer, store)]
        slot = self._slot(req_row).expand(pos.shape)
        rows = t[slot, pos.clamp(min=0).long()]
        return rows.masked_fill((pos < 0).unsqueeze(-1), 0)


def row_layout(config: V4Config, layer: int) -> dict[str, tuple[int, int]]:
    """``store -> (first value, width)`` within one token's row of ``layer`` in the engine's
    pools: the window row, then (compressed layers) the entry of the window this token closes,
    then (CSA) the indexer's entry. Entries sit at the row of their window's last token, so the
    pools' block tables address them; rows of tokens that close no window leave them unused."""
    d = config.head_dim
    layout = {"window": (0, d)}
    if config.compress_rate(layer):
        layout["entries.compressor"] = (d, d)
        if config.layer_types[layer] == CSA:
            layout["entries.indexer"] = (2 * d, config.index_head_dim)
    return layout


def row_values(config: V4Config, layer: int) -> int:
    """Values in one token's row of ``layer`` (`row_layout`)."""
    return sum(width for _, width in row_layout(config, layer).values())


#: the store HiSparse places in the host pool: a compressed sparse layer's entries
HOST_STORE = "entries.compressor"


#: the window rows' ring under HiSparse placement (per request slot, `SlotState`)
WINDOW_RING = "state.window"


def spread_width(width: int, rate: int) -> int:
    """Values per token row of an entry of ``width`` values spread over its window's ``rate``
    token rows (the last row padded)."""
    return -(-width // rate)


def hisparse_row_layout(config: V4Config, layer: int) -> dict[str, tuple[int, int]]:
    """`row_layout` of the per-token row that stays on the GPU under HiSparse placement: the
    window rows live in a ring per request slot (`WINDOW_RING`) and a compressed sparse
    layer's entries (`HOST_STORE`) in their own sparse cache, so a row holds a slice of the
    HCA entry or of the CSA indexer's entry: entry ``w`` is spread over its window's token
    rows ``[w · rate, (w + 1) · rate)``, `spread_width` values each, so these GPU-resident
    entries cost their own size, not a row per token (a window-only layer has none)."""
    rate = config.compress_rate(layer)
    if config.layer_types[layer] == CSA:
        return {"entries.indexer": (0, spread_width(config.index_head_dim, rate))}
    if rate:
        return {"entries.compressor": (0, spread_width(config.head_dim, rate))}
    return {}


class SlotState:
    """The compressors' carried state of every engine request slot: ``[slots, ring, width]``
    per ``(layer, store)`` (the ``state.*`` stores of `store_shapes`); with ``window_ring``
    (HiSparse placement) also every layer's last ``sliding_window`` window rows
    (`WINDOW_RING`). A request only reads positions it wrote itself, so a slot needs no reset
    between requests."""

    def __init__(
        self,
        config: V4Config,
        slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        window_ring: bool = False,
    ) -> None:
        self.stores = {
            key: torch.zeros(slots, length, width, dtype=dtype, device=device)
            for key, (length, width) in store_shapes(config, 1).items()
            if key[1].startswith("state.")
        }
        if window_ring:
            w, d = config.sliding_window, config.head_dim
            for layer in range(config.num_hidden_layers):
                ring = torch.zeros(slots, w, d, dtype=dtype, device=device)
                self.stores[(layer, WINDOW_RING)] = ring
        #: the slot padding rows of a fixed-shape step read and write
        self.spare = slots - 1
