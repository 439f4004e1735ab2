"""The OpenAI-compatible HTTP API (FastAPI) in front of one `AsyncEngine`.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (both streamed as server-sent events
ending in ``data: [DONE]`` when ``stream`` is set), ``/v1/models``, ``/health``, ``/version``,
``/tokenize``, ``/detokenize``, ``/metrics`` (Prometheus text). Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with a 4xx status naming the field; an
overloaded engine answers 503. Bodies are read and parsed here (not by FastAPI) so a
malformed or oversized body gets the same error shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import hisparse
from hisparse.serve.async_engine import AsyncEngine, EngineDead, EngineOverloaded, StreamDelta
from hisparse.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {
            400: "invalid_request",
            401: "invalid_api_key",
            404: "not_found",
            413: "request_too_large",
            503: "overloaded",
        }.get(status, "error")


def _error(status: int, message: str, param: str | None = None, code: str = "") -> JSONResponse:
    err = ApiError(status, message, param, code)
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": err.code}}
    return JSONResponse(body, status_code=status)


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 8 << 20,
    metrics=None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``model_name``."""
    llm = engine.llm
    app = FastAPI(title="hisparse", version=hisparse.__version__)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error(err.status, err.message, err.param, err.code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        guarded = api_key is not None and request.url.path.startswith("/v1")
        if guarded and request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        return await call_next(request)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        body = await request.body()
        if len(body) > max_body_bytes:
            raise ApiError(
                413,
                f"the request body has {len(body):,} bytes; at most "
                f"{max_body_bytes:,} are accepted",
            )
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"]) or None
            raise ApiError(400, f"{loc}: {first['msg']}", loc) from None
        name = getattr(parsed, "model", None)
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist: this server serves "
                f"{model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )
        return parsed

    def token_ids(prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            return llm.encode(prompt)
        vocab = llm.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"{param}: token ids {bad[:5]} are outside [0, {vocab})", param)
        return list(prompt)

    def check_length(ids: list[int], max_tokens: int | None, param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param} is empty; give at least one token", param)
        limit = llm.max_model_len
        if len(ids) >= limit:
            raise ApiError(
                400,
                f"{param} has {len(ids)} tokens; this model's context is "
                f"{limit} (max_model_len), which leaves no room for output",
                param,
            )
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} with a {len(ids)}-token prompt "
                f"passes max_model_len={limit}; ask for at most "
                f"{limit - len(ids)}",
                "max_tokens",
            )

    def sampling(body, max_tokens: int | None, logprobs: int | None):
        try:
            return body.sampling_params(max_tokens, logprobs)
        except (ValueError, TypeError) as e:
            msg = str(e)
            field = msg.split("=", 1)[0].removeprefix("SamplingParams.") if "=" in msg else None
            raise ApiError(400, msg, field) from None

    async def run(ids: list[int], params, prompt: str | None) -> AsyncIterator[list[StreamDelta]]:
        try:
            async for deltas in engine.generate(ids, params, prompt=prompt):
                yield deltas
        except EngineOverloaded as e:
            raise ApiError(503, str(e)) from None
        except EngineDead as e:
            raise ApiError(503, str(e), code="engine_dead") from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None

    async def collect(ids, params, prompt) -> list[dict[str, Any]]:
        outs = [
            dict(text="", token_ids=[], finish_reason=None, logprobs=[]) for _ in range(params.n)
        ]
        async for deltas in run(ids, params, prompt):
            for d in deltas:
                o = outs[d.index]
                o["text"] += d.text
                o["token_ids"] += d.token_ids
                o["logprobs"] += d.logprobs or []
                if d.finish_reason is not None:
                    o["finish_reason"] = d.finish_reason
                if d.error:
                    raise ApiError(400 if d.finish_reason == "error" else 500, d.error)
        return outs

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return dict(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def token_text(t: int) -> str:
        return llm.tokenizer.decode([t]) if llm.tokenizer is not None else str(t)

    def completion_logprobs(token_ids: list[int], lps: list[dict[int, float]], offset: int):
        if not lps:
            return None
        tokens = [token_text(t) for t in token_ids]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return dict(
            tokens=tokens,
            token_logprobs=[lp.get(t) for t, lp in zip(token_ids, lps, strict=False)],
            top_logprobs=[{token_text(k): v for k, v in lp.items()} for lp in lps],
            text_offset=offsets,
        )

    def chat_logprobs(token_ids: list[int], lps: list[dict[int, float]], top: int):
        if not lps:
            return None
        content = []
        for t, lp in zip(token_ids, lps, strict=False):
            s = token_text(t)
            others = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
            content.append(
                dict(
                    token=s,
                    logprob=lp.get(t),
                    bytes=list(s.encode()),
                    top_logprobs=[
                        dict(token=token_text(k), logprob=v, bytes=list(token_text(k).encode()))
                        for k, v in others
                    ],
                )
            )
        return dict(content=content)

    # --- routes -------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return _error(503, f"the engine stopped: {engine.error!r}", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hisparse.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = dict(
            id=model_name,
            object="model",
            created=created,
            owned_by="hisparse",
            root=model_name,
            max_model_len=llm.max_model_len,
        )
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            return PlainTextResponse("", status_code=404)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = chat_ids(body.messages)
        else:
            ids = llm.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, DetokenizeRequest)
        vocab = llm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens: ids must lie in [0, {vocab})", "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens) if llm.tokenizer else ""}

    def chat_ids(messages) -> list[int]:
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in messages]
            return llm.chat_token_ids(msgs)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"messages: {e}", "messages") from None

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompts = body.prompts()
        if len(prompts) != 1:
            raise ApiError(
                400,
                "prompt: send one prompt per request (a list of several is not supported)",
                "prompt",
            )
        text = prompts[0] if isinstance(prompts[0], str) else None
        ids = token_ids(prompts[0], "prompt")
        check_length(ids, body.max_tokens, "prompt")
        params = sampling(body, body.max_tokens, body.logprobs)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = dict(id=rid, object="text_completion", created=now, model=model_name)
        echo = (text or "") if body.echo else ""
        if not body.stream:
            outs = await collect(ids, params, text)
            choices = [
                dict(
                    index=i,
                    text=echo + o["text"],
                    finish_reason=o["finish_reason"],
                    logprobs=completion_logprobs(o["token_ids"], o["logprobs"], len(echo)),
                )
                for i, o in enumerate(outs)
            ]
            n_out = sum(len(o["token_ids"]) for o in outs)
            return {**head, "choices": choices, "usage": usage(len(ids), n_out)}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = run(ids, params, text)
        first = await _first(gen)  # errors before the stream starts are plain JSON errors

        async def stream() -> AsyncIterator[str]:
            n_out, offsets = 0, [len(echo)] * params.n
            if echo:
                for i in range(params.n):
                    yield sse(
                        {
                            **head,
                            "choices": [
                                dict(index=i, text=echo, logprobs=None, finish_reason=None)
                            ],
                        }
                    )
            async for deltas in _chain(first, gen):
                for d in deltas:
                    n_out += len(d.token_ids)
                    lp = completion_logprobs(d.token_ids, d.logprobs or [], offsets[d.index])
                    offsets[d.index] += len(d.text)
                    choice = dict(
                        index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason
                    )
                    yield sse({**head, "choices": [choice]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(len(ids), n_out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse(request, ChatCompletionRequest)
        ids = chat_ids(body.messages)
        limit = body.limit()
        check_length(ids, limit, "messages")
        top = body.top_logprobs or 0
        params = sampling(body, limit, top if body.logprobs else None)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = dict(id=rid, object="chat.completion", created=now, model=model_name)
        if not body.stream:
            outs = await collect(ids, params, None)
            choices = [
                dict(
                    index=i,
                    message=dict(role="assistant", content=o["text"]),
                    finish_reason=o["finish_reason"],
                    logprobs=chat_logprobs(o["token_ids"], o["logprobs"], top),
                )
                for i, o in enumerate(outs)
            ]
            n_out = sum(len(o["token_ids"]) for o in outs)
            return {**head, "choices": choices, "usage": usage(len(ids), n_out)}
        head["object"] = "chat.completion.chunk"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = run(ids, params, None)
        first = await _first(gen)

        async def stream() -> AsyncIterator[str]:
            n_out = 0
            for i in range(params.n):
                yield sse(
                    {
                        **head,
                        "choices": [
                            dict(
                                index=i,
                                delta=dict(role="assistant", content=""),
                                logprobs=None,
                                finish_reason=None,
                            )
                        ],
                    }
                )
            async for deltas in _chain(first, gen):
                for d in deltas:
                    n_out += len(d.token_ids)
                    delta = {"content": d.text} if d.text else {}
                    choice = dict(
                        index=d.index,
                        delta=delta,
                        finish_reason=d.finish_reason,
                        logprobs=chat_logprobs(d.token_ids, d.logprobs or [], top),
                    )
                    yield sse({**head, "choices": [choice]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(len(ids), n_out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


_END = object()


async def _first(gen: AsyncIterator) -> Any:
    """The first item of ``gen`` (``_END`` if none): awaited before a stream's response
    starts, so a request refused by the engine answers with a status code, not a broken
    stream."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _END


async def _chain(first: Any, gen) -> AsyncIterator:
    """``first``, then the rest of ``gen``; closing this (a client gone mid-stream) closes
    ``gen`` at once, which aborts the request in the engine."""
    try:
        if first is _END:
            return
        yield first
        async for item in gen:
            yield item
    finally:
        await gen.aclose()
