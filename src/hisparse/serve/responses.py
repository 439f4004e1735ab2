"""OpenAI's response shapes from the engine's deltas: whole answers, server-sent-event streams,
usage and logprobs.

A stream that fails after it started (a step that raised, a completion the engine failed,
the deadline, a shutdown) cannot change its status any more: every completion not yet ended
gets a final chunk (``finish_reason`` ``"error"``, or ``"abort"`` where the server aborted
it), then one ``data: {"error": ...}`` event in OpenAI's shape, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from hisparse.serve.async_engine import RequestTimedOut, ShuttingDown, StreamDelta
from hisparse.serve.errors import ApiError, failure_of, sse_error

log = logging.getLogger("hisparse.serve")

_END = object()
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache held."""
    return dict(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=dict(cached_tokens=cached_tokens),
    )


def cached_of(outs: list[dict[str, Any]]) -> int:
    """The prompt tokens the prefix cache held for a request: each prompt's, counted once
    (its first completion carries them, `AsyncEngine._delta`)."""
    return sum(o.get("cached_tokens") or 0 for o in outs)


class Formatter:
    """Token text and logprobs in OpenAI's two shapes (completions, chat)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

    def completion_logprobs(
        self, token_ids: list[int], lps: list[dict[int, float]], offset: int
    ) -> dict[str, Any] | None:
        if not lps:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return dict(
            tokens=tokens,
            token_logprobs=[lp.get(t) for t, lp in zip(token_ids, lps, strict=False)],
            top_logprobs=[{self.token_text(k): v for k, v in lp.items()} for lp in lps],
            text_offset=offsets,
        )

    def chat_logprobs(
        self, token_ids: list[int], lps: list[dict[int, float]], top: int
    ) -> dict[str, Any] | None:
        if not lps:
            return None
        content = []
        for t, lp in zip(token_ids, lps, strict=False):
            s = self.token_text(t)
            others = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
            content.append(
                dict(
                    token=s,
                    logprob=lp.get(t),
                    bytes=list(s.encode()),
                    top_logprobs=[
                        dict(
                            token=(k_text := self.token_text(k)),
                            logprob=v,
                            bytes=list(k_text.encode()),
                        )
                        for k, v in others
                    ],
                )
            )
        return dict(content=content)


def _raise_failed(deltas: list[StreamDelta]) -> None:
    for d in deltas:
        if d.error is not None and d.finish_reason == "error":
            raise failure_of(d.error)


async def collect(gen: AsyncIterator[list[StreamDelta]], n: int) -> list[dict[str, Any]]:
    """Every completion's text, token ids, logprobs and finish reason; a completion the
    engine failed raises its `ApiError` (leaving ``gen`` aborts the others)."""
    outs: list[dict[str, Any]] = [
        dict(text="", token_ids=[], finish_reason=None, logprobs=[]) for _ in range(n)
    ]
    async for deltas in gen:
        _raise_failed(deltas)
        for d in deltas:
            o = outs[d.index]
            o["text"] += d.text
            o["token_ids"] += d.token_ids
            o["logprobs"] += d.logprobs or []
            if d.finish_reason is not None:
                o["finish_reason"] = d.finish_reason
            if d.cached_tokens is not None:
                o["cached_tokens"] = d.cached_tokens
    return outs


async def merged(
    gens: list[AsyncIterator[list[StreamDelta]]], n: int
) -> AsyncIterator[list[StreamDelta]]:
    """Several prompts' deltas as one request's (a list of prompts on ``/v1/completions``):
    prompt ``k``'s completion ``i`` becomes choice ``k * n + i``, as OpenAI numbers them.
    Deltas come as the engine steps give them; the first error ends the whole, and closing
    this closes every prompt's iteration (which aborts them in the engine)."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield item
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, gen: AsyncIterator[list[StreamDelta]]) -> None:
        try:
            async for deltas in gen:
                queue.put_nowait([dataclasses.replace(d, index=k * n + d.index) for d in deltas])
        except Exception as err:
            queue.put_nowait(err)
        finally:
            await gen.aclose()
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first(gen: AsyncIterator[list[StreamDelta]]) -> Any:
    """The first item of ``gen``: awaited before a stream's response starts, so that a
    request refused by the server or failed by the engine at once answers with a status
    code and a JSON body, not a broken stream."""
    try:
        item = await gen.__anext__()
    except StopAsyncIteration:
        return _END
    try:
        _raise_failed(item)
    except ApiError:
        await gen.aclose()
        raise
    return item


async def events(
    head: dict[str, Any],
    item: Any,
    gen: AsyncIterator[list[StreamDelta]],
    n: int,
    *,
    opening: list[str],
    chunk: Callable[[StreamDelta], dict[str, Any] | None],
    final: Callable[[int, str], dict[str, Any]],
    tail: Callable[[int, int], list[str]],
) -> AsyncIterator[str]:
    """A stream's server-sent events: ``opening``, one chunk per delta (``chunk``), ``tail``
    (given the output tokens and the cached prompt tokens) and ``[DONE]``; on a failure
    `final` chunks for the completions still open, the error event and ``[DONE]``. Closing
    this (a client gone mid-stream) closes ``gen`` at once, which aborts the request in the
    engine."""
    open_ = set(range(n))
    n_out = cached = 0
    try:
        for e in opening:
            yield e
        while item is not _END:
            for d in item:
                n_out += len(d.token_ids)
                cached += d.cached_tokens or 0
                if d.finish_reason is not None:
                    open_.discard(d.index)
                c = chunk(d)
                if c is not None:  # None: nothing to show yet (a tool call being read)
                    yield sse({**head, "choices": [c]})
            _raise_failed(item)
            item = await anext(gen, _END)
        for e in tail(n_out, cached):
            yield e
        yield DONE
    except ApiError as err:
        reason = "abort" if isinstance(err, RequestTimedOut | ShuttingDown) else "error"
        for i in sorted(open_):
            yield sse({**head, "choices": [final(i, reason)]})
        yield sse_error(err)
        yield DONE
    except Exception as err:  # nothing a stream raises reaches the client as plain text
        log.exception("a stream failed")
        yield sse_error(ApiError(500, f"internal error: {type(err).__name__}: {err}"))
        yield DONE
    finally:
        await gen.aclose()
