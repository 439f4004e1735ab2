"""A real server in a background thread of this process (tests, the soak, notebooks).

It listens on a socket bound before uvicorn starts (port 0: the kernel picks a free port, so
parallel test runs never race for one), and is always stopped on leaving the block: uvicorn
first (the engine aborts what is in flight), then the engine loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hisparse.serve.server import ServerState, bind, make_server


@dataclass
class RunningServer:
    url: str
    port: int
    server: Any
    state: ServerState
    thread: threading.Thread

    @property
    def engine(self) -> Any:
        return self.state.engine

    def stop(self, timeout: float = 30.0) -> None:
        """Stop uvicorn, then the engine loop (idempotent)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.state.engine.shutdown(timeout)


@contextmanager
def serve_in_thread(
    llm: Any, *, host: str = "127.0.0.1", start_timeout: float = 60.0, **kwargs: Any
) -> Iterator[RunningServer]:
    """Serve ``llm`` on ``host`` (any free port) while the block runs; ``kwargs`` go to
    `make_server` (``model_name`` defaults to ``"model"``)."""
    kwargs.setdefault("model_name", "model")
    sock = bind(host, 0)
    port = sock.getsockname()[1]
    try:
        server, state = make_server(llm, host=host, port=port, **kwargs)
    except BaseException:
        sock.close()
        raise
    thread = threading.Thread(
        target=server.run, kwargs=dict(sockets=[sock]), name="hisparse-uvicorn", daemon=True
    )
    thread.start()
    running = RunningServer(f"http://{host}:{port}", port, server, state, thread)
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {start_timeout:g} s")
            time.sleep(0.02)
        yield running
    finally:
        running.stop()
        sock.close()
