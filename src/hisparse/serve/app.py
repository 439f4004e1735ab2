"""The OpenAI-compatible HTTP API (FastAPI) in front of one `AsyncEngine`.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (both streamed as server-sent events
ending in ``data: [DONE]`` when ``stream`` is set), ``/v1/models``, ``/health``, ``/version``,
``/tokenize``, ``/detokenize``, ``/metrics`` (Prometheus text). Every error is OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}`` (`hisparse.serve.errors`), 4xx naming
the field at fault, 5xx for the server's. Bodies are read and parsed here (not by FastAPI) so
a malformed or oversized body gets the same shape.

Each request is bounded before it is queued: its body (``max_body_bytes``), its completions
(``n`` and ``best_of`` at most ``max_n``), its stop strings and ids and logprobs
(`SamplingParams`' limits), its prompts (each within ``max_model_len``), and its
sequences against the queue (`AsyncEngine.admit`). While it waits its client is watched: a
hang-up aborts it at the next step, streamed or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import hisparse
from hisparse.engine.sampling_params import MAX_N
from hisparse.engine.structured_params import StructuredOutputsParams
from hisparse.serve.async_engine import AsyncEngine
from hisparse.serve.errors import ApiError, install_error_handlers
from hisparse.serve.fields import check_extra_fields
from hisparse.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hisparse.serve.responses import (
    Formatter,
    cached_of,
    collect,
    events,
    first,
    merged,
    sse,
    usage,
)
from hisparse.serve.tools import ToolReader, named_schema, parser_for, required_schema


class _ApiKey:
    """Plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which wraps
    ``receive`` and so hides a client's disconnect from the route): ``/v1`` routes need
    ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def watch_disconnect(request: Request) -> Callable[[], Awaitable[None]]:
    """A coroutine function that returns when ``request``'s client hangs up: the body is
    read, so the next ASGI message is ``http.disconnect`` (what ``is_disconnected()`` polls
    for, awaited instead of polled: no delay, no wake-ups)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 8 << 20,
    max_n: int = MAX_N,
    metrics: Any = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``model_name``."""
    llm = engine.llm
    app = FastAPI(title="hisparse", version=hisparse.__version__)
    created = int(time.time())
    fmt = Formatter(llm.tokenizer)
    tool_parser = parser_for(llm.model)
    # the token that ends a thinking answer's reasoning, for the families that think
    think_end = None
    if tool_parser in ("deepseek_v32", "glm") and llm.tokenizer is not None:
        think_end = getattr(llm.tokenizer, "token_to_id", lambda t: None)("</think>")
    install_error_handlers(app)
    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)

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
            first_error = e.errors()[0]
            loc = ".".join(str(p) for p in first_error["loc"]) or None
            raise ApiError(400, f"{loc}: {first_error['msg']}", loc) from None
        refused = getattr(parsed, "refused", None)
        if refused is not None:
            field = check_extra_fields(parsed.model_extra or {}, refused)
            if field is not None:
                raise ApiError(400, f"{field}={data[field]!r}: this server does not implement "
                               f"{field}, which would change the output; leave it out",
                               field, "unsupported_field")  # fmt: skip
        name = getattr(parsed, "model", None)
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist: this server serves "
                f"{model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )
        n = getattr(parsed, "n", 1)
        if n > max_n:  # before anything is tokenized: the cheapest refusal first
            raise ApiError(400, f"n={n}: at most {max_n} completions per request (--max-n)",
                           "n", "n_too_large")  # fmt: skip
        best_of = getattr(parsed, "best_of", None)
        if best_of is not None and best_of > max_n:
            raise ApiError(400, f"best_of={best_of}: at most {max_n} (--max-n)", "best_of")
        if best_of is not None and best_of != n:
            raise ApiError(400, f"best_of={best_of}: only best_of == n ({n}) is supported "
                           "(every completion is returned)", "best_of")  # fmt: skip
        return parsed

    def encode(text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return llm.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as e:  # no tokenizer: the client must send token ids
            raise ApiError(400, f"{param}: {e}", param, "no_tokenizer") from None

    def token_ids(prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            return encode(prompt, param)
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

    async def sampling(body, max_tokens: int | None, logprobs: int | None, tool_spec=None,
                       think_end: int | None = None):  # fmt: skip
        try:
            spec, field = body.structured()
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(":", 1)[0]) from None
        if tool_spec is not None:  # a named or required tool choice
            if spec is not None:
                raise ApiError(400, f"{field}: not with tool_choice {body.tool_mode()!r}, "
                               "which constrains the answer itself", field)  # fmt: skip
            spec, field = tool_spec, "tools"
        if spec is not None and think_end is not None:  # a thinking answer reasons first:
            spec = dataclasses.replace(spec, after_token=think_end)  # constrained from </think>
        if spec is not None:  # compiled here (cached), so a bad schema is a 400
            try:
                await asyncio.to_thread(llm.grammars.compile, spec)
            except ValueError as e:
                raise ApiError(400, f"{field}: {e}", field) from None
        try:
            return body.sampling_params(max_tokens, logprobs, spec)
        except (ValueError, TypeError) as e:
            msg = str(e)
            field = msg.split("=", 1)[0].removeprefix("SamplingParams.") if "=" in msg else None
            raise ApiError(400, msg, field) from None

    def chat_ids(messages, **template_kwargs) -> list[int]:
        try:
            msgs = [m.for_template() for m in messages]
            return llm.chat_token_ids(msgs, **template_kwargs)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"messages: {e}", "messages") from None

    eos = set(llm.eos_token_ids)

    def raw_text(ids: list[int]) -> str:
        """The answer with its special tokens (a tool-call format may be written in them)."""
        return llm.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=False)

    def tool_reader(body) -> tuple[ToolReader, StructuredOutputsParams | None]:
        """How ``body``'s answers are read (its tool_choice) and the structured output a
        named or required choice constrains them to."""
        try:
            mode, tools = body.tool_mode(), body.template_tools()
            name = body.tool_choice.function.name if mode == "named" else None
            schema = None
            if mode == "named":
                schema = named_schema(tools, name)
            elif mode == "required":
                schema = required_schema(tools)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None
        kw = body.chat_template_kwargs or {}
        if tool_parser == "glm":  # GLM-5's template thinks unless told not to
            thinks = bool(kw.get("enable_thinking", True))
        else:
            thinks = bool(kw.get("thinking") or kw.get("enable_thinking"))
        end = think_end if thinks else None
        spec = None if schema is None else StructuredOutputsParams(json=schema)
        return ToolReader(mode, name, tool_parser, raw_text, end), spec

    # --- routes -------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            raise ApiError(503, f"the engine stopped: {engine.error!r}", code="engine_dead")
        if not engine.healthy:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
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
            ids = encode(body.prompt, "prompt", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, DetokenizeRequest)
        vocab = llm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens: ids must lie in [0, {vocab})", "tokens")
        if llm.tokenizer is None:
            raise ApiError(400, "tokens: this checkpoint has no tokenizer.json to decode with",
                           "tokens", "no_tokenizer")  # fmt: skip
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompts = body.prompts()
        n = body.n
        if len(prompts) > 1 and len(prompts) * n > engine.max_waiting:
            raise ApiError(400, f"prompt: {len(prompts)} prompts x n={n} sequences can never "
                           f"fit the server's queue of {engine.max_waiting} (--max-waiting)",
                           "prompt", "too_many_sequences")  # fmt: skip
        texts, all_ids = [], []
        for k, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            ids = token_ids(p, param)
            check_length(ids, body.max_tokens, param)
            texts.append(p if isinstance(p, str) else None)
            all_ids.append(ids)
        params = await sampling(body, body.max_tokens, body.logprobs)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = dict(id=rid, object="text_completion", created=now, model=model_name)
        # choice k * n + i is prompt k's completion i (OpenAI's numbering)
        echo = [(t or "") if body.echo else "" for t in texts for _ in range(n)]
        gen = merged([
            engine.generate(ids, params, prompt=t, disconnected=watch_disconnect(request))
            for ids, t in zip(all_ids, texts, strict=True)
        ], n)  # fmt: skip
        n_prompt = sum(len(ids) for ids in all_ids)
        if not body.stream:
            outs = await collect(gen, n * len(prompts))
            choices = [
                dict(
                    index=i,
                    text=echo[i] + o["text"],
                    finish_reason=o["finish_reason"],
                    logprobs=fmt.completion_logprobs(o["token_ids"], o["logprobs"], len(echo[i])),
                )
                for i, o in enumerate(outs)
            ]
            n_out = sum(len(o["token_ids"]) for o in outs)
            return {**head, "choices": choices, "usage": usage(n_prompt, n_out, cached_of(outs))}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        item = await first(gen)  # errors before the stream starts are plain JSON errors
        offsets = [len(e) for e in echo]

        def chunk(d) -> dict[str, Any]:
            lp = fmt.completion_logprobs(d.token_ids, d.logprobs or [], offsets[d.index])
            offsets[d.index] += len(d.text)
            return dict(index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason)

        opening = [
            sse({**head, "choices": [dict(index=i, text=e, logprobs=None, finish_reason=None)]})
            for i, e in enumerate(echo) if e
        ]  # fmt: skip
        stream = events(
            head, item, gen, len(echo), opening=opening, chunk=chunk,
            final=lambda i, why: dict(index=i, text="", logprobs=None, finish_reason=why),
            tail=lambda n_out, cached: [
                sse({**head, "choices": [], "usage": usage(n_prompt, n_out, cached)})
            ]
            if include_usage else [],
        )  # fmt: skip
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse(request, ChatCompletionRequest)
        reader, tool_spec = tool_reader(body)
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:  # rendered even under "none", as vLLM does: the model knows them
            kwargs["tools"] = body.template_tools()
        ids = chat_ids(body.messages, **kwargs)
        limit = body.limit()
        check_length(ids, limit, "messages")
        top = body.top_logprobs or 0
        params = await sampling(body, limit, top if body.logprobs else None, tool_spec,
                                reader.think_end)  # fmt: skip
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = dict(id=rid, object="chat.completion", created=now, model=model_name)
        gen = engine.generate(ids, params, disconnected=watch_disconnect(request))
        if not body.stream:
            outs = await collect(gen, params.n)
            choices = []
            for i, o in enumerate(outs):
                message, why = reader.message(o["text"], o["token_ids"], o["finish_reason"])
                lp = fmt.chat_logprobs(o["token_ids"], o["logprobs"], top)
                choices.append(dict(index=i, message=message, finish_reason=why, logprobs=lp))
            n_out = sum(len(o["token_ids"]) for o in outs)
            return {**head, "choices": choices, "usage": usage(len(ids), n_out, cached_of(outs))}
        head["object"] = "chat.completion.chunk"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        item = await first(gen)

        def chunk(d) -> dict[str, Any] | None:
            delta, why = reader.delta(d.index, d.text, d.token_ids, d.finish_reason)
            if delta is None:
                return None
            lp = fmt.chat_logprobs(d.token_ids, d.logprobs or [], top)
            return dict(index=d.index, delta=delta, finish_reason=why, logprobs=lp)

        opening = [
            sse({**head, "choices": [dict(index=i, delta=dict(role="assistant", content=""),
                                          logprobs=None, finish_reason=None)]})
            for i in range(params.n)
        ]  # fmt: skip
        stream = events(
            head, item, gen, params.n, opening=opening, chunk=chunk,
            final=lambda i, why: dict(index=i, delta={}, logprobs=None, finish_reason=why),
            tail=lambda n_out, cached: [
                sse({**head, "choices": [], "usage": usage(len(ids), n_out, cached)})
            ]
            if include_usage else [],
        )  # fmt: skip
        return StreamingResponse(stream, media_type="text/event-stream")

    return app
