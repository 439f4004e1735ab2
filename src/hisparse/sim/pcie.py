"""Host-to-device time of a step's misses at measured rates.

A zero-copy gather's rate depends on the bytes of each contiguous read (a row, or a token's
span of an index group) and on how many reads one call makes (docs/design.md §10). The table
is that measurement: GB/s at (span bytes, reads); between points the rate is interpolated
linearly in log(reads) and log(span bytes), and held at the edges.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

#: docs/benchmarks.md §18, one H200 over PCIe Gen5 x16 (Triton zero-copy gather from a 16 GiB
#: pinned pool, fresh rows per run; 656 B: sorted by address, as the swap lists are; the
#: 4 KiB row is the middle of that table's range for 4 KiB spans; the bulk copy caps it all)
DEFAULT_RATES: dict[str, list] = {
    "reads": [2048, 16384, 131072],
    "span_bytes": [656, 1152, 1312, 2624, 4096, 1 << 30],
    "gb_s": [
        [13.7, 22.7, 24.8],
        [22.6, 32.9, 32.4],
        [27.5, 37.2, 35.9],
        [36.7, 46.3, 47.6],
        [45.5, 45.5, 45.5],
        [55.5, 55.5, 55.5],
    ],
    "source": "docs/benchmarks.md §18 (H200, PCIe Gen5 x16)",
}


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear in log(x) between the points, held at the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lx = math.log(x)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            a, b = math.log(xs[i - 1]), math.log(xs[i])
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (lx - a) / (b - a)
    return ys[-1]


@dataclass(frozen=True)
class RateTable:
    """GB/s of gathers of ``reads`` spans of ``span_bytes`` each."""

    reads: list[int]
    span_bytes: list[int]
    #: gb_s[i][j]: rate at span_bytes[i], reads[j]
    gb_s: list[list[float]]
    source: str = ""

    def __post_init__(self) -> None:
        if sorted(self.reads) != list(self.reads) or sorted(self.span_bytes) != list(
            self.span_bytes
        ):
            raise ValueError("rate table: reads and span_bytes must be ascending")
        if len(self.gb_s) != len(self.span_bytes) or any(
            len(row) != len(self.reads) for row in self.gb_s
        ):
            raise ValueError("rate table: gb_s must be [len(span_bytes)][len(reads)]")
        if any(v <= 0 for row in self.gb_s for v in row):
            raise ValueError("rate table: every rate must be positive")

    @classmethod
    def from_dict(cls, d: dict) -> RateTable:
        return cls(
            reads=[int(v) for v in d["reads"]],
            span_bytes=[int(v) for v in d["span_bytes"]],
            gb_s=[[float(v) for v in row] for row in d["gb_s"]],
            source=str(d.get("source", "")),
        )

    @classmethod
    def load(cls, path: Path | None) -> RateTable:
        """The table in ``path`` (JSON with ``reads``, ``span_bytes``, ``gb_s``), or the
        default measured on the H200."""
        return cls.from_dict(DEFAULT_RATES if path is None else json.loads(path.read_text()))

    def gb_s_at(self, span_bytes: int, reads: int) -> float:
        per_span = [_interp(reads, self.reads, row) for row in self.gb_s]
        return _interp(span_bytes, self.span_bytes, per_span)

    def seconds(self, span_bytes: int, reads: int) -> float:
        """Time of one gather of ``reads`` spans (0 when nothing moves)."""
        if reads <= 0:
            return 0.0
        return reads * span_bytes / (self.gb_s_at(span_bytes, reads) * 1e9)
