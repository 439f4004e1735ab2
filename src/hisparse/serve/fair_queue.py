"""Round-robin order over requests' sequences: one request's fan-out never starves others.

A request with ``n`` completions is ``n`` sequences for the scheduler, and the scheduler
admits in arrival order. Given all at once, one ``n=128`` request would run ahead of every
later request until its 128 sequences had all been admitted. The server therefore holds the
sequences here and hands the scheduler one per request in turn, only as the batch has room:
a request arriving behind any number of large fan-outs waits for at most one sequence of
each request ahead of it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class FairQueue:
    """Requests with sequences still held, in turn order; not thread-safe (the engine loop
    owns it)."""

    def __init__(self) -> None:
        #: key -> [item, next index, count]
        self._turns: OrderedDict[str, list[Any]] = OrderedDict()
        self.held = 0

    def __bool__(self) -> bool:
        return bool(self._turns)

    def __len__(self) -> int:
        """Sequences held."""
        return self.held

    def push(self, key: str, item: Any, count: int) -> None:
        """Hold ``count`` sequences of ``item``; it takes its first turn after every request
        already here has taken one more."""
        if count > 0:
            self._turns[key] = [item, 0, count]
            self.held += count

    def pop(self) -> tuple[Any, int]:
        """The next sequence: (its request's item, its index); that request goes to the back
        of the turn order (or leaves, with its last sequence)."""
        key, turn = next(iter(self._turns.items()))
        item, i, count = turn
        if i + 1 == count:
            del self._turns[key]
        else:
            turn[1] = i + 1
            self._turns.move_to_end(key)
        self.held -= 1
        return item, i

    def remove(self, key: str) -> int:
        """Forget ``key``'s sequences still held; how many there were."""
        turn = self._turns.pop(key, None)
        if turn is None:
            return 0
        left = turn[2] - turn[1]
        self.held -= left
        return left
