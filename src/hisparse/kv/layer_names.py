"""Short names for lists of layers in plans and error messages: ``layers.0-11.attn`` for
twelve numbered layers, index groups by their leaders."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hisparse.kv.layout import IndexGroupLayout

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D.*)?$")


def compact_layer_names(names: Sequence[str]) -> str:
    """``layers.0.attn .. layers.11.attn`` -> ``layers.0-11.attn``; gaps -> ``layers.[0-2,6].x``."""
    runs: list[tuple[tuple[str, str] | None, list]] = []
    for name in names:
        m = _NUMBERED.match(name)
        key = (m.group(1), m.group(3) or "") if m else None
        if key is not None and runs and runs[-1][0] == key:
            runs[-1][1].append(int(m.group(2)))  # type: ignore[union-attr]
        else:
            runs.append((key, [int(m.group(2))] if m else [name]))
    parts = []
    for key, items in runs:
        if key is None:
            parts.append(str(items[0]))
            continue
        ranges = _ranges(items)
        body = ranges if len(ranges.split(",")) == 1 else f"[{ranges}]"
        parts.append(f"{key[0]}{body}{key[1]}")
    return ", ".join(parts)


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 6, 10, 14]`` -> ``"0-2,6-14 by 4"`` (IndexShare schedules stay short)."""
    out: list[str] = []
    i = 0
    while i < len(numbers):
        j = i + 1
        if j < len(numbers) and numbers[j] > numbers[i]:
            step = numbers[j] - numbers[i]
            while j + 1 < len(numbers) and numbers[j + 1] - numbers[j] == step:
                j += 1
            run = j - i + 1
            if step == 1 or run >= 3:
                suffix = "" if step == 1 else f" by {step}"
                out.append(f"{numbers[i]}-{numbers[j]}{suffix}")
                i = j + 1
                continue
        out.append(str(numbers[i]))
        i += 1
    return ",".join(out)


def summarize_index_groups(groups: Sequence[IndexGroupLayout]) -> str:
    """``"21 (19 of 4 layers, 2 of 1 layer)"``: how the sparse layers share top-k."""
    sizes: dict[int, int] = {}
    for group in groups:
        sizes[len(group.layers)] = sizes.get(len(group.layers), 0) + 1
    detail = ", ".join(
        f"{count} of {size} layer{'s' if size > 1 else ''}"
        for size, count in sorted(sizes.items(), reverse=True)
    )
    return f"{len(groups)} ({detail})"
