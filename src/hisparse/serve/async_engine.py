"""One engine loop for a server: requests arrive at any time, tokens stream out per step.

The loop runs in its own thread and owns the `LLM` (its scheduler, model and caches): nothing
else calls the model. HTTP handlers talk to it through a thread-safe inbox (new requests,
aborts) and read per-request `asyncio.Queue`s that the loop fills with `loop.call_soon_threadsafe`
after every engine step, so the event loop never blocks on a step. With no work the loop
sleeps on the inbox. An abort (client gone, timeout) is applied at the next step boundary and
frees the request's blocks there.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams


class EngineOverloaded(RuntimeError):
    """More requests wait than the server admits to its queue (answered with 503)."""


class EngineDead(RuntimeError):
    """The engine loop stopped with an error; the server cannot serve requests any more."""


@dataclass
class StreamDelta:
    """What one engine step added to one completion: the new token ids (and their logprobs),
    the text now safe to show, and the finish reason once it ended."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    reqs: list[Request]
    #: characters of each completion's text already handed out
    sent_chars: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    #: longest stop string: text that could still turn into one is held back
    hold: int = 0


class AsyncEngine:
    """Runs an `LLM`'s steps in a background thread for concurrent streaming clients.

    ``max_waiting`` bounds the requests queued beyond what the scheduler runs: one more is
    refused with `EngineOverloaded` instead of growing the queue without end."""

    def __init__(self, llm, *, max_waiting: int = 256, metrics=None) -> None:
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._aborted = 0
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="hisparse-engine", daemon=True)
        self.thread.start()

    # --- the HTTP side (event loop) -----------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
    ) -> AsyncIterator[list[StreamDelta]]:
        """Stream the deltas of every engine step for this prompt's ``params.n`` completions
        until all of them finished. Cancelling the iteration (client gone) aborts them."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        if self.num_waiting() >= self.max_waiting:
            raise EngineOverloaded(
                f"{self.num_waiting()} requests are waiting (the server queues at most "
                f"{self.max_waiting}); retry later"
            )
        rid = f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", rid, prompt_token_ids, params, prompt, loop, out))
        finished = False
        try:
            while True:
                item = await out.get()
                if item is None:  # every completion ended
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self._inbox.put(("abort", rid))

    def num_waiting(self) -> int:
        return len(self.llm.scheduler.waiting) + self._inbox.qsize()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the step in flight; unfinished requests are aborted."""
        self._stop.set()
        self._inbox.put(("wake",))
        self.thread.join(timeout)

    # --- the engine side (its own thread) -----------------------------------------------
    def _loop(self) -> None:
        llm = self.llm
        try:
            while not self._stop.is_set():
                block = not llm.has_unfinished_requests()
                self._drain(block)
                if self._stop.is_set():
                    break
                if not llm.has_unfinished_requests():
                    continue
                changed = llm.step()
                self._publish(changed)
                if self.metrics is not None:
                    self.metrics.after_step(llm, changed, self._aborted)
                self._aborted = 0
        except BaseException as err:  # the engine is gone: every client hears it
            self.error = err
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for s in streams:
                s.loop.call_soon_threadsafe(s.out.put_nowait, EngineDead(repr(err)))
        finally:
            for rid in list(self._streams):
                self._abort(rid)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            _, rid, ids, params, prompt, loop, out = item
            try:
                reqs = self.llm.add_request(ids, params, request_id=rid, prompt=prompt)
            except (ValueError, TypeError) as err:
                loop.call_soon_threadsafe(out.put_nowait, err)
                return
            n = len(reqs)
            hold = max((len(s) for s in params.stop), default=0)
            stream = _Stream(loop, out, reqs, [0] * n, [0] * n, [False] * n, max(hold - 1, 0))
            with self._lock:
                self._streams[rid] = stream
            self._publish(reqs)  # a request that failed its checks ends at once
        elif kind == "abort":
            self._abort(item[1])

    def _abort(self, rid: str) -> None:
        with self._lock:
            s = self._streams.pop(rid, None)
        if s is not None:
            for req in s.reqs:
                if not req.finished:
                    self.llm.abort_request(req.req_id)
                    self._aborted += 1

    def _publish(self, changed: list[Request]) -> None:
        ids = {id(r) for r in changed}
        with self._lock:
            touched = [
                (rid, s) for rid, s in self._streams.items() if any(id(r) in ids for r in s.reqs)
            ]
        for rid, s in touched:
            deltas = [d for i, req in enumerate(s.reqs) if (d := self._delta(s, i, req))]
            if deltas:
                s.loop.call_soon_threadsafe(s.out.put_nowait, deltas)
            if all(s.done):
                with self._lock:
                    self._streams.pop(rid, None)
                s.loop.call_soon_threadsafe(s.out.put_nowait, None)

    @staticmethod
    def _delta(s: _Stream, i: int, req: Request) -> StreamDelta | None:
        """Completion ``i``'s new tokens and text since the last delta (None: nothing new)."""
        if s.done[i]:
            return None
        toks = req.output_token_ids[s.sent_tokens[i] :]
        done = req.finished
        # text that a stop string could still claim stays back until it is decided
        upto = len(req.text) if done else max(len(req.text) - s.hold, s.sent_chars[i])
        while not done and upto > s.sent_chars[i] and req.text[upto - 1] == "\ufffd":
            upto -= 1  # an incomplete UTF-8 sequence: its character comes with a later token
        text = req.text[s.sent_chars[i] : upto]
        if not toks and not text and not done:
            return None
        lps = None
        if req.logprobs is not None:
            lps = req.logprobs[s.sent_tokens[i] : s.sent_tokens[i] + len(toks)]
        s.sent_tokens[i] += len(toks)
        s.sent_chars[i] = upto
        s.done[i] = done
        return StreamDelta(
            index=req.index,
            token_ids=list(toks),
            text=text,
            finish_reason=req.finish_reason if done else None,
            logprobs=lps,
            error=req.error,
        )
