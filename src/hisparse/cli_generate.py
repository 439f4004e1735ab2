"""``hisparse generate``: answer a prompt with the KV cache in the HiSparse host pool.

With no ``--prompt`` it runs the built-in demo: a chat question about a passage of the Python
language reference that ships with every Python (``pydoc_data``), long enough that each
layer's GPU hot buffer holds fewer rows than the context, so decode steps really swap rows in
from host memory. It ends with one summary line: speed, hit rate, and KV bytes kept on the
host against those on the GPU. Ctrl-C prints the answer so far and "interrupted" (exit
status 130).

On the CPU the first request of a process compiles the batch-1 kernels with numba (or loads
them from its cache in ``__pycache__``), inside its prefill and first decode step. The
summary measures that time (`CompileClock`: the spans numba holds its compiler lock) and
subtracts it from the time to first token and the decode rate, where it fell, and prints it
apart with the load time: the request's times are those of a process with its kernels ready.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from rich.console import Console

from hisparse.config import HiSparseConfig, cdiv
from hisparse.engine.speculative import SPECULATIVE_HELP, SpeculativeConfig

if TYPE_CHECKING:
    from hisparse.runtime.ops.cpu.compile import CompileClock

#: Demo settings: top_k 128 -> a 256-row hot buffer per layer, under the ~600-token context.
DEMO_TOP_K = 128
DEMO_QUESTION = "Summarize this passage in one sentence."
#: Exit status after Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130
#: The parallelism flags' `LLM` arguments (error messages name the flag).
PARALLEL_FLAGS = {
    "LLM.tensor_parallel_size": "--tensor-parallel-size",
    "LLM.data_parallel_size": "--data-parallel-size",
    "LLM.enable_expert_parallel": "--enable-expert-parallel",
}
#: The API field each flag sets, for error messages in the flag's terms.
FLAGS = {
    "SamplingParams.max_tokens": "--max-tokens",
    "SamplingParams.temperature": "--temperature",
    "SamplingParams.seed": "--seed",
    "HiSparseConfig.top_k": "--top-k",
    "HiSparseConfig.device_buffer_size": "--device-buffer-size",
    "HiSparseConfig.host_pool_gib": "--host-pool-gib",
    "HiSparseConfig.offload": "--offload",
    "LLM.gpu_memory_gib": "--gpu-memory-gib",
    "LLM.max_model_len": "--max-model-len",
    "LLM.kv_placement": "--kv-placement",
    "LLM.device": "--device",
    "LLM.model": "--model",
    **PARALLEL_FLAGS,
}


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``, ``--data-parallel-size``, ``--enable-expert-parallel``
    (vLLM's names) on a command that builds an engine; `parallel_kwargs` reads them."""
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to shard the model over, one GPU each (default 1); see the README for torchrun",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel attention: ranks that each run their own requests with their own KV "
        "cache and host pool, one GPU each (default 1); not with --tensor-parallel-size",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --data-parallel-size: split each MoE layer's routed experts over the ranks",
    )


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )


def demo_prompt() -> str:
    from pydoc_data.topics import topics

    return topics["for"].strip() + "\n\n" + DEMO_QUESTION


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text (default: the built-in SmolLM2 demo)",
        description="Generate with the KV cache in host memory and a small GPU hot buffer.",
    )
    gen.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (bundled), a Llama .gguf file, or a DSA checkpoint folder",
    )
    gen.add_argument("--prompt", default=None, help="the user message (default: the demo)")
    gen.add_argument(
        "--no-chat", action="store_true", help="send the prompt without the model's chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--top-k", type=int, default=None, help=f"rows each token attends to (demo: {DEMO_TOP_K})"
    )
    gen.add_argument(
        "--device-buffer-size",
        type=int,
        default=None,
        help="hot rows per request and layer (default (max_query_len+1)*top_k)",
    )
    gen.add_argument(
        "--host-pool-gib", type=float, default=None, help="default: what the request needs"
    )
    gen.add_argument(
        "--offload",
        default=None,
        help="under_pressure (default): pages stay on the GPU while there is room; "
        "always: only tail pages on the GPU",
    )
    gen.add_argument("--gpu-memory-gib", type=float, default=None)
    gen.add_argument("--max-model-len", type=int, default=4096)
    gen.add_argument("--kv-placement", choices=("hisparse", "gpu"), default="hisparse")
    gen.add_argument("--device", default=None)
    add_parallel_args(gen)
    gen.add_argument("--speculative-config", default=None, help=SPECULATIVE_HELP)
    gen.set_defaults(handler=run_generate, flags=FLAGS, builds_engine=True)


def run_generate(args: argparse.Namespace) -> int:
    from hisparse.engine.sampling import SamplingParams

    if args.seed is not None and args.temperature == 0:
        # greedy decoding draws no random numbers (SamplingParams.greedy)
        print("note: --seed has no effect with --temperature 0 (greedy decoding)", file=sys.stderr)
    demo = args.prompt is None
    top_k = args.top_k if args.top_k is not None else (DEMO_TOP_K if demo else None)
    # every flag checked before the model loads
    config = HiSparseConfig(
        top_k=top_k,
        device_buffer_size=args.device_buffer_size,
        host_pool_gib=args.host_pool_gib,
        offload=args.offload,
    )
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    args.speculative_config = SpeculativeConfig.of(args.speculative_config)
    console = Console()
    try:
        return _generate(args, console, config, params, demo)
    except KeyboardInterrupt as err:
        partial = getattr(err, "outputs", None)  # `GenerationInterrupted` from generate()
        if partial:
            console.print(f"[bold]Answer (so far):[/] {partial[0].text.strip()}")
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _generate(
    args: argparse.Namespace, console: Console, config: HiSparseConfig, params: object, demo: bool
) -> int:
    from hisparse.engine.llm import LLM

    t0 = time.perf_counter()
    with loading_display(console, args.model):
        llm = LLM(
            args.model,
            kv_placement=args.kv_placement,
            hisparse=config,
            max_model_len=args.max_model_len,
            gpu_memory_gib=args.gpu_memory_gib,
            device=args.device,
            max_num_seqs=1,
            **parallel_kwargs(args),
            speculative_config=args.speculative_config,
        )
    load_s = time.perf_counter() - t0
    with llm:
        text = demo_prompt() if demo else args.prompt
        if llm.tokenizer is None:
            raise ValueError("this model has no tokenizer; use the Python API with token ids")
        if args.no_chat or llm.chat_template is None:
            ids = llm.tokenizer.encode(text)
            ids = list(getattr(ids, "ids", ids))
        else:
            chat = llm.chat_template.render([{"role": "user", "content": text}])
            ids = llm.tokenizer.encode(chat, add_special_tokens=False)
            ids = list(getattr(ids, "ids", ids))
        if demo:
            console.print(
                f"[bold]Prompt[/] ({len(ids)} tokens): a passage of the Python "
                f"reference (pydoc_data 'for'), then: {DEMO_QUESTION}"
            )
        clock = kernel_clock(llm)
        with console.status("generating"), clock or nullcontext():
            (out,) = llm.generate(prompt_token_ids=ids, sampling_params=params)
        if out.error:
            raise ValueError(out.error)
        console.print(f"[bold]Answer:[/] {out.text.strip()}")
        console.print(summary_line(llm, out, load_s, clock) + fp8_report(llm))
    return 0


def kernel_clock(llm: object) -> CompileClock | None:
    """A `CompileClock` for a CPU run whose compiled kernels are on (``None`` otherwise),
    holding already the span of their set-up (numba's import, the kernels' wrappers)."""
    if llm.device.type != "cpu":  # type: ignore[attr-defined]
        return None
    from hisparse.runtime.ops import cpu_backend
    from hisparse.runtime.ops.cpu.compile import CompileClock

    t0 = time.perf_counter()
    if cpu_backend().jit() is None:
        return None
    clock = CompileClock()
    clock.spans.append((t0, time.perf_counter()))
    return clock


def summary_line(llm: object, out: object, load_s: float, clock: CompileClock | None = None) -> str:
    """Speed, hit rate, and where this request's KV bytes live; with a ``clock``, the time to
    first token and the decode rate without the kernels' one-time compile, printed apart."""
    m = out.metrics  # type: ignore[attr-defined]
    n_out = len(out.token_ids)  # type: ignore[attr-defined]
    ctx = len(out.prompt_token_ids) + n_out  # type: ignore[attr-defined]
    times = m.token_times
    ttft = m.ttft
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    if clock is not None and ttft is not None:
        ttft -= clock.seconds(m.arrival, m.first_token)
        span -= clock.seconds(times[0], times[-1])
    decode = (
        f"decode {(len(times) - 1) / span:.1f} tok/s"
        if len(times) > 1 and span > 0
        else "decode n/a (one token)"
    )
    layout = llm.kv.layout  # type: ignore[attr-defined]
    cfg = llm.config  # type: ignore[attr-defined]
    bs = layout.block_size
    if layout.placement == "hisparse":
        host_b = cdiv(ctx, bs) * layout.host_block_bytes
        gpu_b = layout.gpu_blocks_per_request(ctx) * layout.gpu_bytes_per_block
        where = (
            f"KV on host {host_b / 2**20:.1f} MiB, on GPU {gpu_b / 2**20:.1f} MiB when "
            f"offloaded (hot buffer {cfg.device_buffer_size} rows/layer for {ctx} tokens)"
        )
        if m.hits + m.misses:
            rate = m.hits / (m.hits + m.misses)
            hits = f"hit rate {100 * rate:.1f}% ({m.misses} rows swapped in)"
        elif cfg.offload == "under_pressure":
            hits = (
                "no swaps (the GPU pool had room, so every page stayed resident; "
                "--offload always reads older pages through the hot buffer)"
            )
        else:
            hits = "no swaps (every row it read was resident)"
    else:
        gpu_b = layout.gpu_blocks_per_request(ctx) * layout.gpu_bytes_per_block
        where, hits = f"KV on GPU {gpu_b / 2**20:.1f} MiB (all-GPU placement)", "no swaps"
    once = f"loaded in {load_s:.1f} s"
    if clock is not None and clock.spans:
        what = (
            "kernels compiled in {:.1f} s (first run only)"
            if clock.compiled
            else "kernels loaded from numba's cache in {:.1f} s"
        )
        once += ", " + what.format(clock.seconds()) + ", not counted above"
    return f"{n_out} tokens, {decode}, time to first token {ttft:.2f} s, {hits}, {where}; {once}"


def loading_display(console: Console, model: object) -> Any:
    """What shows while the model loads: a DSA checkpoint's progress bar (GB read, GB/s,
    drawn by its loader), or a spinner for a GGUF model."""
    from hisparse.models.checkpoint import show_progress

    name = str(model)
    if name.endswith(".gguf") or name.lower().startswith("smollm2"):
        return console.status("loading the model")
    return show_progress(console)


def fp8_report(llm: object) -> str:
    """``; fp8 GEMMs: ...``: the kernels an fp8 checkpoint's layers run (empty otherwise)."""
    from hisparse.models.fp8_linear import Fp8Linear, kernels_used
    from hisparse.models.fp8_moe import Fp8Experts

    model = llm.model  # type: ignore[attr-defined]
    if not any(isinstance(m, Fp8Linear | Fp8Experts) for m in model.modules()):
        return ""
    return "; fp8 GEMMs: " + ", ".join(kernels_used())
