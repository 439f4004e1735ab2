"""``hisparse serve``: the OpenAI-compatible HTTP server (`hisparse.serve`) for one model.

Requests are admitted by the engine's scheduler as capacity allows (continuous batching, the
same admission, preemption and HiSparse rules as `LLM.generate`) and stream their tokens as
each step finishes. Loopback by default: pass ``--host 0.0.0.0`` (and ``--api-key``) to serve
others.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math

from rich.console import Console

from hisparse.cli_generate import add_parallel_args, parallel_kwargs
from hisparse.cli_options import add_model_option, add_options, model_of
from hisparse.defaults import DEFAULT_MODEL
from hisparse.engine.sampling_params import MAX_N
from hisparse.engine.speculative import SPECULATIVE_HELP, SpeculativeConfig
from hisparse.models.source import require_weights, resolve_model_source

#: uvicorn's log levels (``hisparse.serve.server.LOG_LEVELS``: uvicorn is imported only
#: when the server runs)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    add_model_option(p, default=DEFAULT_MODEL, positional=True)
    p.add_argument(
        "--served-model-name", default=None, help="the name clients use (default: the model)"
    )
    add_options(p, "--host", "--port")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
        "(default: none, open)",
    )  # fmt: skip
    add_options(
        p, "--kv-placement", "--max-num-seqs", "--max-model-len", "--max-num-batched-tokens"
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="sequences queued, not yet running, before 503 (a request adds its n); "
        "a request with more gets 400 (default: %(default)s)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=MAX_N,
        help=f"completions per request (n, best_of), at most {MAX_N} (default: %(default)s)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=0,
        help="seconds from arrival to the last token before a request is aborted "
        "(504); 0: no deadline, max_tokens and max_model_len bound every request "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=8 << 20,
        help="largest request body accepted (default: %(default)s)",
    )  # fmt: skip
    add_options(
        p, "--sparse-top-k", "--hot-buffer-rows", "--host-pool-gib", "--offload",
        "--gpu-memory-gib", "--gpu-memory-utilization", "--dtype", "--device",
    )  # fmt: skip
    add_parallel_args(p)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the cached pages of earlier requests' shared prefixes (default: on)",
    )
    p.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS,
        help="server log level (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--speculative-config", default=None, help=SPECULATIVE_HELP + " (default: none)")
    p.set_defaults(handler=run_serve, builds_engine=True)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before anything is bound or loaded (each names its flag)."""
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port}: must be in 0..65535 (0: any free port)")
    if not args.host:
        raise ValueError("--host '': give an address, e.g. --host 127.0.0.1")
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting {args.max_waiting}: must be >= 1, e.g. --max-waiting 256")
    if not 1 <= args.max_n <= MAX_N:
        raise ValueError(f"--max-n {args.max_n}: must be in 1..{MAX_N}")
    if not math.isfinite(args.request_timeout) or args.request_timeout < 0:
        raise ValueError(
            f"--request-timeout {args.request_timeout}: must be >= 0 seconds (0: no deadline)"
        )
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes {args.max_body_bytes}: must be >= 1")
    args.speculative_config = SpeculativeConfig.of(args.speculative_config)


def run_serve(args: argparse.Namespace) -> int:
    from hisparse.config import HiSparseConfig
    from hisparse.engine.llm import LLM
    from hisparse.serve.server import bind, make_server

    check_args(args)
    config = HiSparseConfig(
        top_k=args.sparse_top_k, device_buffer_size=args.hot_buffer_rows,
        host_pool_gib=args.host_pool_gib, offload=args.offload,
    )  # fmt: skip
    if config.top_k is not None:
        config.resolve()  # a budget no hot buffer can hold, named before the model loads
    args.model = model_of(args)
    sock = bind(args.host, args.port)  # a port in use fails now, not after the load
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("hisparse").setLevel(args.log_level.upper().replace("TRACE", "DEBUG"))
    port = sock.getsockname()[1]
    console = Console()
    try:
        require_weights(resolve_model_source(args.model, name="--model"), "serve", "--model")
        with console.status("loading the model"):
            llm = LLM(
                args.model,
                kv_placement=args.kv_placement,
                hisparse=config,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_gib=args.gpu_memory_gib,
                gpu_memory_utilization=args.gpu_memory_utilization,
                dtype=args.dtype,
                device=args.device,
                **parallel_kwargs(args),
                enable_prefix_caching=args.enable_prefix_caching,
                speculative_config=args.speculative_config,
            )
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or str(args.model)
    with llm:
        server, state = make_server(
            llm, model_name=name, host=args.host, port=port, api_key=args.api_key,
            max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting,
            max_n=args.max_n, request_timeout=args.request_timeout or None,
            log_level=args.log_level,
        )  # fmt: skip
        # one line, flushed, unwrapped: scripts (and the tests) read the port from it
        print(
            f"serving {name} on http://{args.host}:{port}/v1 ({args.kv_placement} "
            f"placement, up to {args.max_num_seqs} running)",
            flush=True,
        )
        # the loaded model's objects live as long as the process: the collector's full
        # passes skip them (on the CPU a pass over them costs a decode step's time or more)
        gc.freeze()
        try:
            server.run(sockets=[sock])
        finally:
            state.engine.shutdown()
            sock.close()
            gc.unfreeze()  # `llm.close()` collects the runner's cycles
    return state.exit_code
