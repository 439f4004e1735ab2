"""Putting the server together: an `LLM`, its engine loop, the app, its metrics, uvicorn.

Stopping is bounded: on SIGTERM / SIGINT (or ``should_exit``) the engine aborts every
request in flight first, so their handlers answer at once (503, or a stream's error event)
and uvicorn's wait for open connections ends within a step, not when the longest generation
would have; ``graceful_timeout`` bounds that wait anyway. An engine that stopped for good
(`AsyncEngine.on_fatal`) stops the server with ``exit_code`` 1.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn

from hisparse.engine.sampling_params import MAX_N
from hisparse.serve.app import build_app
from hisparse.serve.async_engine import AsyncEngine
from hisparse.serve.metrics import ServerMetrics

log = logging.getLogger("hisparse.serve")

#: uvicorn's log levels (``--log-level``)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    app: Any
    #: the process's exit status once the server stopped: 1 when the engine failed
    exit_code: int = 0
    #: signals received (a SIGTERM ends the server gracefully, not the process at once)
    signals: list[int] = field(default_factory=list)


class _Server(uvicorn.Server):
    """uvicorn's server, told to abort the engine's requests before it waits for their
    connections, and not to re-raise the signal that stopped it (the caller closes the
    engine and returns an exit status)."""

    state: ServerState

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: flags only (the engine is told from the event loop, in shutdown)
        self.state.signals.append(sig)
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for anything
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.engine.begin_shutdown()
        await super().shutdown(sockets=sockets)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one), made before the model
    loads so that a port in use or a bad host fails in a second, not after the load.
    Raises `OSError` naming the address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def make_server(
    llm: Any,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 8 << 20,
    max_waiting: int = 256,
    max_n: int = MAX_N,
    request_timeout: float | None = None,
    graceful_timeout: float = 3.0,
    log_level: str = "warning",
) -> tuple[uvicorn.Server, ServerState]:
    """A uvicorn server (not started: call ``run()``, or ``run(sockets=[bind(...)])``) for
    ``llm``; its engine loop thread starts now. Stop with ``should_exit = True``, then
    ``state.engine.shutdown()``."""
    if log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level {log_level}: use one of {', '.join(LOG_LEVELS)}")
    metrics = ServerMetrics(model_name)
    holder: dict[str, _Server] = {}

    def on_fatal(err: BaseException) -> None:
        state.exit_code = 1
        log.critical("the engine failed (%r): stopping the server, exit status 1", err)
        if "server" in holder:
            holder["server"].should_exit = True

    engine = AsyncEngine(
        llm, max_waiting=max_waiting, request_timeout=request_timeout, metrics=metrics,
        on_fatal=on_fatal,
    )  # fmt: skip
    app = build_app(
        engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
        max_n=max_n, metrics=metrics,
    )  # fmt: skip
    state = ServerState(engine, metrics, app)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=graceful_timeout,
    )  # fmt: skip
    server = _Server(config)
    server.state = state
    holder["server"] = server
    return server, state
