"""Putting the server together: an `LLM`, its engine loop, the app, its metrics, uvicorn."""

from __future__ import annotations

from dataclasses import dataclass

import uvicorn

from hisparse.serve.app import build_app
from hisparse.serve.async_engine import AsyncEngine
from hisparse.serve.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    app: object


def make_server(
    llm,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 8 << 20,
    max_waiting: int = 256,
    log_level: str = "warning",
) -> tuple[uvicorn.Server, ServerState]:
    """A uvicorn server (not started: call ``run()``, or ``serve()`` in a running loop) for
    ``llm``; its engine loop thread starts now. Stop with ``should_exit = True``, then
    ``state.engine.shutdown()``."""
    metrics = ServerMetrics(model_name)
    engine = AsyncEngine(llm, max_waiting=max_waiting, metrics=metrics)
    app = build_app(
        engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
        metrics=metrics,
    )  # fmt: skip
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    return uvicorn.Server(config), ServerState(engine, metrics, app)
