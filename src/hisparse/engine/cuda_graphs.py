"""Fixed-shape decode steps, captured as one CUDA graph per padded batch size.

A decode batch of ``R`` requests is padded to the next size of `padded_sizes` (1, 2, 4, ...,
``max_num_seqs``). The step's per-row inputs (token id, position, hot-state slot, request key)
travel in one pinned host-to-device copy into persistent device buffers; everything from there
to the logits (block-table gathers, step metadata, the model with its indexer, the swap-in =
resolve + gathers on the copy stream, sparse attention, the MoE) reads only those buffers and
persistent state, without a host read, so it is captured once per size and replayed. Sampling
stays outside the graph.

A size has two graphs at most: the general step, and the step of a batch whose requests hold
every page resident (HiSparse with ``offload="under_pressure"`` while the pool has room), which
looks its rows up in the resident table as the all-GPU placement does (`StepMetadata.
all_resident`). Where both kinds occur, the first step of a size whose batch is all resident
captures both (the general step is valid there too: its resolve finds every row resident), so
that the first demotion at that size replays at once instead of compiling and capturing
mid-serving, a stall of every running request. A size first seen with demoted requests
captures the general kind only: the resident kind's step on such a batch would attend without
the host rows and write wrong new rows from the second layer on, so it is captured (after one
eager run) when an all-resident batch of that size first comes.

A verify step of speculative decoding (each request's last token and up to k drafts) has
its own `DecodeGraphs` with ``rows = k + 1`` rows per request: request ``r`` holds rows
``r·rows ..`` (its last token, its drafts, then padding rows), and each row is, for the model,
a one-row decode of its own (its position, its length ``position + 1``, its request's tables),
while the runtime resolves all rows of a request against its one hot buffer.

Padded rows carry slot ``-1``: no hot state is resolved for them, their block-table rows read
as empty (0), their write slots are ``-1`` (nothing written, nothing mirrored) and their
``req_index`` is ``-1`` (the indexer picks nothing), so attention sees no row for them and the
real rows' values do not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Rows of the input buffer: token id, position, hot-state slot (-1: padding), request key.
INPUT_ROWS = 4


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below ``max_num_seqs``, then it."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


#: The step body: (padded size, every page resident) -> (logits ``[b, vocab]``, counters
#: ``[b, 3]``).
StepFn = Callable[[int, bool], tuple[torch.Tensor, torch.Tensor]]
#: A captured step: (padded size, every page resident).
GraphKey = tuple[int, bool]


class DecodeGraphs:
    """Persistent decode inputs, one CUDA graph per padded size (captured lazily), replay.

    Args:
        max_num_seqs: the largest decode batch.
        device: where the step runs; graphs only on CUDA.
        capture: capture graphs (CUDA); ``False`` runs the same fixed-shape step eagerly
            (the CPU, swap-in timing, debugging).
        rows: rows per request (``k + 1`` for a speculative verify step; `load_rows`).
    """

    def __init__(
        self, max_num_seqs: int, device: torch.device, *, capture: bool, rows: int = 1
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device: pass cuda_graphs=False")
        self.sizes = padded_sizes(max_num_seqs)
        self.device = device
        self.capture = capture
        self.rows = rows
        B = self.sizes[-1] * rows
        pin = device.type == "cuda"
        self.host_inputs = torch.zeros((INPUT_ROWS, B), dtype=torch.int64, pin_memory=pin)
        self._host_np = self.host_inputs.numpy()
        #: ``[INPUT_ROWS, max batch]`` int64 on the device; the graphs read slices ``[:, :b]``.
        self.inputs = torch.zeros((INPUT_ROWS, B), dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, tuple[torch.Tensor, torch.Tensor]] = {}
        #: steps run per (padded size, kind) (eager warm-up steps included)
        self.steps_by_kind: dict[GraphKey, int] = {}

    def padded_size(self, n: int) -> int:
        for b in self.sizes:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} exceeds max_num_seqs={self.sizes[-1]}")

    def load(self, ids: list[int], positions: list[int], slots: list[int], keys: list[int]) -> int:
        """Write one step's rows (padding after them) and copy them to the device; returns
        the padded size. The pinned buffer is rewritten only after its last copy finished."""
        if self.rows != 1:
            raise ValueError(f"load: {self.rows} rows per request, use load_rows")
        b = self.padded_size(len(ids))
        h = self._writable()
        h[:, len(ids) :] = 0
        h[2, len(ids) :] = -1
        h[0, : len(ids)], h[1, : len(ids)], h[2, : len(ids)], h[3, : len(ids)] = (
            ids, positions, slots, keys,
        )  # fmt: skip
        self._copy()
        return b

    def load_rows(
        self, ids: list[list[int]], starts: list[int], slots: list[int], keys: list[int]
    ) -> int:
        """`load` of a verify step: request ``r``'s tokens ``ids[r]`` (its last token and its
        drafts, at most ``rows``) at positions ``starts[r]``, ``starts[r] + 1``, ...; its
        remaining rows and the padding requests' rows get slot ``-1``. Returns the padded
        number of requests."""
        q = self.rows
        b = self.padded_size(len(ids))
        h = self._writable()
        h[:] = 0
        h[2] = -1
        for r, toks in enumerate(ids):
            if not 0 < len(toks) <= q:
                raise ValueError(f"load_rows: {len(toks)} rows for a request, want 1..{q}")
            lo, n = r * q, len(toks)
            h[0, lo : lo + n] = toks
            h[1, lo : lo + n] = range(starts[r], starts[r] + n)
            h[2, lo : lo + n] = slots[r]
            h[3, lo : lo + n] = keys[r]
        self._copy()
        return b

    def _writable(self):
        """The pinned host rows, once their last copy to the device has finished."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host_np

    def _copy(self) -> None:
        self.inputs.copy_(self.host_inputs, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()

    @property
    def steps(self) -> dict[int, int]:
        """Steps run per padded size, of either kind."""
        out: dict[int, int] = {}
        for (b, _), n in self.steps_by_kind.items():
            out[b] = out.get(b, 0) + n
        return out

    @property
    def captured_sizes(self) -> list[int]:
        """Padded sizes with a captured graph (of either kind), ascending."""
        return sorted({b for b, _ in self.graphs})

    def run(
        self,
        b: int,
        step: StepFn,
        *,
        all_resident: bool = False,
        both_kinds: bool = False,
        keep_state: Callable[[], Callable[[], None]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs of the step at padded size ``b`` (``all_resident``: the kind of step):
        replayed if captured; else run eagerly (the first step of a kind also compiles its
        kernels) and, with ``capture``, captured for the next steps of that kind, and of the
        general kind too with ``both_kinds`` when the batch is all resident, run once more
        eagerly first from the state ``keep_state`` (`StepHooks.keep_step_state`) copied
        before the step. Outputs are the graph's buffers: read them before the next step."""
        key = (b, all_resident)
        self.steps_by_kind[key] = self.steps_by_kind.get(key, 0) + 1
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return self.outputs[key]
        # The general kind once more eagerly, to compile its kernels before its capture: on an
        # all-resident batch it computes what the resident step does (its resolve finds every
        # row resident and changes no hot state), from the hooks' state as it was before that
        # step, so it makes the same choices and writes the same new rows and mirror again;
        # its outputs are dropped.
        repeat = self.capture and both_kinds and all_resident and (b, False) not in self.graphs
        rewind = keep_state() if repeat and keep_state is not None else None
        out = step(b, all_resident)
        if self.capture:
            kinds = [all_resident]
            if repeat:
                if rewind is not None:
                    rewind()
                step(b, False)
                kinds.append(False)
            for kind in kinds:
                # Capture records without running: the eager step above did this step's work.
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.outputs[b, kind] = step(b, kind)
                self.graphs[b, kind] = graph
        return out
