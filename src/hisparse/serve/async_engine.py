"""One engine loop for a server: requests arrive at any time, tokens stream out per step.

The loop runs in its own thread and owns the `LLM` (its scheduler, model and caches): nothing
else calls the model. HTTP handlers talk to it through a thread-safe inbox (new requests,
aborts) and read per-request `asyncio.Queue`s that the loop fills with `loop.call_soon_threadsafe`
after every engine step, so the event loop never blocks on a step. With no work the loop
sleeps on the inbox. An abort (client gone, deadline passed, shutdown) is applied at the next
step boundary and frees the request's blocks there.

Bounds, so that no single client can take the server:

- A request is refused before it is queued when its sequences (``n``) could never fit the
  queue (400 naming ``n``) or do not fit it now (503 with ``Retry-After``): the queue counts
  *sequences* not yet running, here and in the scheduler, against ``max_waiting``.
- Fan-out is fair (`FairQueue`): the sequences of all requests enter the scheduler one per
  request in turn, only as the batch has room, so one ``n=128`` request delays a later
  ``n=1`` request by at most one sequence per request ahead of it.
- A deadline (``request_timeout``) and the client's disconnect abort a request.
- A step that raises fails the requests in the scheduler (running, or handed to it for the
  next admission; their clients get a 500), those still held here wait on, and the loop
  goes on; ``max_step_failures`` failures in a row (or an engine that closed itself)
  stop it: every client gets a 500, ``/health`` a 503, and ``on_fatal`` ends the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hisparse.engine.request import Request, completion_seed
from hisparse.engine.sampling_params import SamplingParams
from hisparse.serve.errors import ApiError
from hisparse.serve.fair_queue import FairQueue

log = logging.getLogger("hisparse.serve")


class EngineOverloaded(ApiError):
    """The queue holds too many sequences for this request now: 503 with ``Retry-After``."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(503, message, code="overloaded",
                         headers={"Retry-After": str(retry_after)})  # fmt: skip


class EngineDead(ApiError):
    """The engine loop stopped with an error; the server cannot serve requests any more."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="engine_dead")


class ShuttingDown(ApiError):
    """The server is stopping: in-flight requests are aborted, new ones refused (503)."""

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(503, message, code="shutting_down")


class RequestTimedOut(ApiError):
    """The request passed its deadline (``--request-timeout``) and was aborted (504)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            504, f"the request did not finish within {seconds:g} s (--request-timeout); "
            "it was aborted", code="request_timeout",
        )  # fmt: skip


class ClientGone(ApiError):
    """The client hung up before the answer (nobody reads this 499)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection")


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
    #: with the first completion's finish: the prompt tokens the prefix cache held
    cached_tokens: int | None = None


@dataclass(eq=False)
class Stream:
    """One HTTP request's completions as the loop tracks them."""

    rid: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    #: `time.perf_counter()` when the server accepted it (the engine's TTFT counts from it)
    arrival: float
    #: the engine request of each completion (None: still held in the fair queue)
    reqs: list[Request | None] = field(default_factory=list)
    #: characters / tokens of each completion already handed out
    sent_chars: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    #: longest stop string less one: text that could still turn into one is held back
    hold: int = 0

    def __post_init__(self) -> None:
        n = self.params.n
        self.reqs, self.done = [None] * n, [False] * n
        self.sent_chars, self.sent_tokens = [0] * n, [0] * n
        self.hold = max(max((len(s) for s in self.params.stop), default=0) - 1, 0)


_GONE, _TIMED_OUT = object(), object()


class AsyncEngine:
    """Runs an `LLM`'s steps in a background thread for concurrent streaming clients.

    ``max_waiting``: sequences queued beyond what runs (one request's ``n`` counts ``n``);
    ``request_timeout``: seconds from arrival to the last token (None: no deadline);
    ``on_fatal(err)``: called once from the loop thread when the engine stops for good."""

    def __init__(
        self,
        llm: Any,
        *,
        max_waiting: int = 256,
        request_timeout: float | None = None,
        max_step_failures: int = 3,
        metrics: Any = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.llm = llm
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.max_step_failures = max_step_failures
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.error: BaseException | None = None
        self.step_failures = 0
        self._aborted = 0
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._fair = FairQueue()
        #: id(engine request) -> (its stream, its completion index)
        self._owner: dict[int, tuple[Stream, int]] = {}
        self._ids = itertools.count()
        #: sequences accepted but not yet in the scheduler (inbox and fair queue)
        self._held = 0
        #: the scheduler's waiting list, as the loop last saw it
        self._sched_waiting = 0
        self._lock = threading.Lock()
        self._finishes: deque[float] = deque(maxlen=4096)
        #: sequences finished per second lately (the Retry-After estimate)
        self._finish_rate = 0.0
        self._closing = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="hisparse-engine", daemon=True)
        self.thread.start()

    # --- the HTTP side (event loop) -----------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.error is None and self.thread.is_alive() and not self._closing

    def num_waiting(self) -> int:
        """Sequences accepted and not yet running (held here or waiting in the scheduler)."""
        return self._held + self._sched_waiting

    def admit(self, n: int) -> None:
        """Count ``n`` more sequences against the queue, or refuse them: 400 when they could
        never fit it, 503 (with ``Retry-After``) when they do not fit now, 503 when the
        engine is dead or stopping."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        if self._closing:
            raise ShuttingDown()
        if n > self.max_waiting:
            raise ApiError(
                400, f"n={n}: the request's {n} sequences can never fit the server's queue of "
                f"{self.max_waiting} (--max-waiting); ask for at most {self.max_waiting}",
                "n", "too_many_sequences",
            )  # fmt: skip
        with self._lock:
            queued = self._held + self._sched_waiting
            if queued + n > self.max_waiting:
                excess = queued + n - self.max_waiting
                rate = self._finish_rate
                wait = math.ceil(excess / rate) if rate > 0 else 1
                raise EngineOverloaded(
                    f"{queued} sequences are queued and the server queues at most "
                    f"{self.max_waiting} (--max-waiting); this request adds {n}: retry later",
                    min(max(wait, 1), 60),
                )
            self._held += n

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        disconnected: Callable[[], Awaitable[Any]] | None = None,
    ) -> AsyncIterator[list[StreamDelta]]:
        """Stream the deltas of every engine step for this prompt's ``params.n`` completions
        until all of them finished. Leaving the iteration early aborts them; so does the
        deadline (`RequestTimedOut`) and ``disconnected()`` returning (`ClientGone`): the
        coroutine that returns when the client hangs up. Raises `ApiError`s."""
        self.admit(params.n)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        rid = f"req-{next(self._ids)}"
        stream = Stream(rid, loop, out, prompt_token_ids, params, prompt, time.perf_counter())
        self._inbox.put(("add", stream))
        timer = None
        if self.request_timeout is not None:
            timer = loop.call_later(self.request_timeout, out.put_nowait, _TIMED_OUT)
        watcher = None
        if disconnected is not None:
            watcher = asyncio.ensure_future(disconnected())
            watcher.add_done_callback(lambda t: _gone(t, out))
        finished = False
        try:
            while True:
                item = await out.get()
                if item is None:  # every completion ended
                    finished = True
                    return
                if item is _GONE:
                    raise ClientGone()
                if item is _TIMED_OUT:
                    raise RequestTimedOut(self.request_timeout or 0)
                if isinstance(item, BaseException):
                    finished = True  # the loop already dropped this stream
                    raise item
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            if watcher is not None:
                watcher.cancel()
            if not finished:
                self._inbox.put(("abort", rid))

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and abort those in flight at the next step boundary: their
        clients get a 503 (or a stream's error event), so the HTTP server can stop at once
        instead of waiting for every generation to end."""
        self._closing = True
        self._inbox.put(("shutdown", reason))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the step in flight; unfinished requests are aborted."""
        self._closing = True
        self._stop.set()
        self._inbox.put(("wake",))
        self.thread.join(timeout)

    # --- the engine side (its own thread) -----------------------------------------------
    def _loop(self) -> None:
        llm = self.llm
        try:
            while not self._stop.is_set():
                busy = llm.has_unfinished_requests() or bool(self._fair)
                self._drain(None if busy else 0.5)
                if self._stop.is_set():
                    break
                self._release()
                if not llm.has_unfinished_requests():
                    continue
                try:
                    changed = llm.step()
                except Exception as err:
                    self._step_failed(err)
                    continue
                self.step_failures = 0
                self._publish(changed)
                self._after_step(changed)
                if not changed and not llm.scheduler.running:
                    self._drain(0.005)  # nothing could run: do not spin on the scheduler
        except BaseException as err:  # the engine is gone: every client hears it
            self._die(err)
        finally:
            stopped: ApiError = ShuttingDown("the server stopped before this request finished")
            if self.error is not None:
                stopped = EngineDead(f"the engine stopped: {self.error!r}")
            while True:  # requests that arrived as the loop stopped: nobody will run them
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "add":
                    self._streams[item[1].rid] = item[1]
                    self._fair.push(item[1].rid, item[1], item[1].params.n)
            for s in list(self._streams.values()):
                try:
                    self._end(s, stopped)
                except Exception:  # an engine past aborting (it closed itself): still tell
                    self._streams.pop(s.rid, None)
                    _send(s, stopped)

    def _drain(self, timeout: float | None) -> None:
        """Handle every message in the inbox; wait up to ``timeout`` seconds for the first
        (None: do not wait)."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        touched = False
        while True:
            touched |= self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        if touched:  # an abort frees its blocks now: the gauges show it now
            self._update_gauges()

    def _handle(self, item: tuple) -> bool:
        """One inbox message; whether it changed what runs."""
        kind = item[0]
        if kind == "add":
            s: Stream = item[1]
            self._streams[s.rid] = s
            self._fair.push(s.rid, s, s.params.n)
            return False
        if kind == "abort":
            s = self._streams.get(item[1])
            if s is not None:
                self._drop(s)
            return s is not None
        if kind == "shutdown":
            for s in list(self._streams.values()):
                self._end(s, ShuttingDown(item[1]))
            return True
        return False

    def _release(self) -> None:
        """Move held sequences into the scheduler, one per request in turn (`FairQueue`),
        while the batch has room for them."""
        llm = self.llm
        sched = llm.scheduler
        room = sched.max_num_seqs - len(sched.running) - len(sched.waiting)
        while room > 0 and self._fair:
            s, i = self._fair.pop()
            with self._lock:
                self._held -= 1
            params = _one(s.params, i)
            try:
                (req,) = llm.add_request(
                    s.prompt_token_ids, params, request_id=f"{s.rid}.{i}", prompt=s.prompt
                )
            except (ValueError, TypeError) as err:
                self._end(s, ApiError(400, str(err)))
                continue
            except Exception as err:
                log.exception("adding request %s failed", s.rid)
                self._end(s, ApiError(500, f"the engine could not queue this request: {err!r}"))
                continue
            req.metrics.arrival = s.arrival  # time held here counts in the TTFT
            s.reqs[i] = req
            self._owner[id(req)] = (s, i)
            room -= 1
        self._sched_waiting = self.llm.engine_gauges().waiting

    def _drop(self, s: Stream) -> None:
        """Forget stream ``s`` and abort its unfinished sequences (their blocks are freed
        now); those still held are never queued."""
        if self._streams.pop(s.rid, None) is None:
            return
        held = self._fair.remove(s.rid)
        with self._lock:
            self._held -= held
        for req in s.reqs:
            if req is None:
                continue
            self._owner.pop(id(req), None)
            if not req.finished:
                self.llm.abort_request(req.req_id)
                self._aborted += 1
        self._sched_waiting = self.llm.engine_gauges().waiting

    def _end(self, s: Stream, err: ApiError) -> None:
        """Abort stream ``s`` and tell its handler why."""
        self._drop(s)
        _send(s, err)

    def _publish(self, changed: list[Request]) -> None:
        touched: dict[str, tuple[Stream, list[int]]] = {}
        for req in changed:
            entry = self._owner.get(id(req))
            if entry is None:
                continue
            s, i = entry
            if req.finished:
                del self._owner[id(req)]
            touched.setdefault(s.rid, (s, []))[1].append(i)
        now = time.monotonic()
        for s, indices in touched.values():
            if self._streams.get(s.rid) is not s:
                continue  # aborted meanwhile
            deltas = [d for i in sorted(indices) if (d := self._delta(s, i))]
            for d in deltas:
                if d.finish_reason is not None:
                    self._finishes.append(now)
            if deltas:
                _send(s, deltas)
            if all(s.done):
                del self._streams[s.rid]
                _send(s, None)
        while self._finishes and self._finishes[0] < now - 30:
            self._finishes.popleft()
        span = now - self._finishes[0] if self._finishes else 0.0
        self._finish_rate = len(self._finishes) / max(span, 1.0)

    @staticmethod
    def _delta(s: Stream, i: int) -> StreamDelta | None:
        """Completion ``i``'s new tokens and text since the last delta (None: nothing new)."""
        req = s.reqs[i]
        if s.done[i] or req is None:
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
            index=i,
            token_ids=list(toks),
            text=text,
            finish_reason=req.finish_reason if done else None,
            logprobs=lps,
            error=req.error,
            # a prompt's cached tokens, once: with its first completion's finish
            cached_tokens=req.metrics.cached_tokens if done and i == 0 else None,
        )

    # --- failures ------------------------------------------------------------------------
    def _step_failed(self, err: Exception) -> None:
        """A step raised: fail the requests in the scheduler, running or waiting (the
        step's, and those it was to admit: the loop hands the scheduler no more than the
        batch has room for), free their blocks, go on; sequences still held here are not
        touched. Raises (the engine stops) after ``max_step_failures`` failures in a row,
        or when the engine closed itself."""
        self.step_failures += 1
        log.error("engine step failed (%d in a row)", self.step_failures, exc_info=err)
        if self.step_failures >= self.max_step_failures or getattr(self.llm, "closed", False):
            raise err
        failure = ApiError(
            500, f"the engine step running this request failed ({type(err).__name__}: {err}); "
            "the request was aborted, the server goes on", code="engine_step_failed",
        )  # fmt: skip
        sched = self.llm.scheduler
        victims = [*sched.running, *sched.waiting]
        for req in victims:
            entry = self._owner.get(id(req))
            if entry is not None and entry[0].rid in self._streams:
                self._end(entry[0], failure)
        for req in victims:  # (none should be left: every request belongs to a stream)
            if not req.finished:
                self.llm.abort_request(req.req_id)
        self._sched_waiting = self.llm.engine_gauges().waiting
        self._update_gauges()

    def _die(self, err: BaseException) -> None:
        """The engine stops for good: every client gets a 500, later ones a 503."""
        self.error = err
        log.critical("the engine loop stopped: %r", err, exc_info=err)
        failure = ApiError(500, f"the engine failed ({type(err).__name__}: {err}); the "
                           "server is stopping", code="engine_failed")  # fmt: skip
        for s in list(self._streams.values()):
            try:
                self._end(s, failure)
            except Exception:  # the engine may be past aborting: the client still hears it
                self._streams.pop(s.rid, None)
                _send(s, failure)
        if self.on_fatal is not None:
            try:
                self.on_fatal(err)
            except Exception:
                log.exception("on_fatal failed")

    # --- metrics -------------------------------------------------------------------------
    def _after_step(self, changed: list[Request]) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.after_step(self.llm, changed, self._aborted, self.num_waiting())
        except Exception:  # metrics never stop the engine
            log.exception("updating the metrics failed")
        self._aborted = 0

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.gauges(self.llm, self.num_waiting(), self._aborted)
        except Exception:
            log.exception("updating the metrics failed")
        self._aborted = 0


def _one(params: SamplingParams, i: int) -> SamplingParams:
    """Completion ``i`` of ``params`` as a request of its own (n=1), drawing what the
    engine's own ``n > 1`` would draw: its seed is `completion_seed` of ``(seed, i)``."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else completion_seed(params.seed, i)
    return replace(params, n=1, seed=seed)


def _send(s: Stream, item: Any) -> None:
    """Hand ``item`` to stream ``s``'s handler (nothing if its event loop is gone)."""
    with contextlib.suppress(RuntimeError):  # the event loop closed (the server stopped)
        s.loop.call_soon_threadsafe(s.out.put_nowait, item)


def _gone(task: asyncio.Future, out: asyncio.Queue) -> None:
    if task.cancelled():
        return
    task.exception()  # (retrieved: a receive that failed means the client is gone too)
    out.put_nowait(_GONE)
