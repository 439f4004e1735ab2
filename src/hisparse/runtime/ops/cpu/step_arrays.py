"""numpy views of one step's metadata for the compiled batch-1 decode path of the runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hisparse.runtime.batch import GroupTables, StepMetadata


class StepArrays:
    """numpy views of one step's metadata, made once per step for every layer, and of the
    resident block table of each group's `GroupTables` (`resident_of`)."""

    __slots__ = ("_dev_rows", "_resident", "host_row", "meta", "q", "slot", "source", "state")

    def __init__(self, meta: StepMetadata) -> None:
        self.meta = meta
        self.q = int(meta.req_per_token.numpy()[0]) if meta.req_per_token.shape[0] else -1
        self.state = meta.request_state_indices.numpy()
        self.source = meta.source_block_table.numpy()
        written = meta.host_slot_mapping
        self.host_row = int(written.numpy()[0]) if written is not None and written.shape[0] else -1
        #: The state slot of request ``q`` (``-1``: none, or ``q`` outside the state list).
        self.slot = int(self.state[self.q]) if 0 <= self.q < self.state.shape[0] else -1
        self._resident: list[tuple[GroupTables, np.ndarray | None]] = []
        self._dev_rows: list[tuple[GroupTables, int]] = []

    def resident_of(self, tables: GroupTables) -> np.ndarray | None:
        for known, array in self._resident:
            if known is tables:
                return array
        table = tables.resident_block_table
        array = None if table is None else table.numpy()
        self._resident.append((tables, array))
        return array

    def dev_row_of(self, tables: GroupTables) -> int:
        """The resident row the step's one new token is written to (``-1``: none)."""
        for known, row in self._dev_rows:
            if known is tables:
                return row
        mapping = tables.slot_mapping
        row = int(mapping.numpy()[0]) if mapping.shape[0] else -1
        self._dev_rows.append((tables, row))
        return row
