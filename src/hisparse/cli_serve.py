"""``hisparse serve``: the OpenAI-compatible HTTP server (`hisparse.serve`) for one model.

Requests are admitted by the engine's scheduler as capacity allows (continuous batching, the
same admission, preemption and HiSparse rules as `LLM.generate`) and stream their tokens as
each step finishes. Loopback by default: pass ``--host 0.0.0.0`` (and ``--api-key``) to serve
others.
"""

from __future__ import annotations

import argparse

from rich.console import Console

#: The API field each flag sets, for error messages in the flag's terms.
FLAGS = {
    "HiSparseConfig.top_k": "--top-k",
    "HiSparseConfig.device_buffer_size": "--device-buffer-size",
    "HiSparseConfig.host_pool_gib": "--host-pool-gib",
    "HiSparseConfig.offload": "--offload",
    "LLM.gpu_memory_gib": "--gpu-memory-gib",
    "LLM.max_model_len": "--max-model-len",
    "LLM.max_num_seqs": "--max-num-seqs",
    "LLM.max_num_batched_tokens": "--max-batched-tokens",
    "LLM.kv_placement": "--kv-placement",
    "LLM.device": "--device",
    "LLM.model": "--model",
    "LLM.tensor_parallel_size": "--tensor-parallel-size",
}


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a DSA folder")
    p.add_argument("--served-model-name", default=None, help="the name clients use (--model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--kv-placement", choices=("hisparse", "gpu"), default="hisparse")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="tokens per step")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--top-k", type=int, default=None, help="rows each token attends to")
    p.add_argument("--device-buffer-size", type=int, default=None, help="hot rows per layer")
    p.add_argument("--host-pool-gib", type=float, default=None)
    p.add_argument(
        "--offload",
        default=None,
        help="under_pressure (default): pages stay on the GPU while there is room; "
        "always: only tail pages on the GPU",
    )
    p.add_argument("--gpu-memory-gib", type=float, default=None)
    p.add_argument("--device", default=None)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to shard the model over, one GPU each (default 1); see the README for torchrun",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(handler=run_serve, flags=FLAGS, builds_engine=True)


def run_serve(args: argparse.Namespace) -> int:
    from hisparse.config import HiSparseConfig
    from hisparse.engine.llm import LLM
    from hisparse.serve.server import make_server

    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: must be in 1..65535")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting}: must be >= 0")
    config = HiSparseConfig(
        top_k=args.top_k, device_buffer_size=args.device_buffer_size,
        host_pool_gib=args.host_pool_gib, offload=args.offload,
    )  # fmt: skip
    console = Console()
    with console.status("loading the model"):
        llm = LLM(
            args.model,
            kv_placement=args.kv_placement,
            hisparse=config,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_batched_tokens,
            gpu_memory_gib=args.gpu_memory_gib,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    name = args.served_model_name or str(args.model)
    with llm:
        server, state = make_server(
            llm, model_name=name, host=args.host, port=args.port, api_key=args.api_key,
            max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting,
            log_level=args.log_level,
        )  # fmt: skip
        console.print(
            f"serving [bold]{name}[/] on http://{args.host}:{args.port}/v1 "
            f"({args.kv_placement} placement, up to {args.max_num_seqs} running)"
        )
        try:
            server.run()
        finally:
            state.engine.shutdown()
    return 0
