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
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from hisparse.cli_options import add_model_option, add_option, add_options
from hisparse.config import HiSparseConfig, cdiv
from hisparse.defaults import DEFAULT_MODEL
from hisparse.engine.speculative import SPECULATIVE_HELP, SpeculativeConfig
from hisparse.models.source import require_weights, resolve_model_source

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


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``, ``--data-parallel-size``, ``--enable-expert-parallel``
    (vLLM's names) on a command that builds an engine; `parallel_kwargs` reads them."""
    add_options(p, "--tensor-parallel-size", "--data-parallel-size")
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
    add_model_option(gen, default=DEFAULT_MODEL)
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="the user message (default: the demo)")
    source.add_argument(
        "--prompt-file",
        metavar="PATH",
        default=None,
        help="read the user message from a file, or '-' for stdin (no argument-length limit; "
        "default: --prompt)",
    )
    gen.add_argument(
        "--no-chat", action="store_true", help="send the prompt without the model's chat template"
    )
    gen.add_argument(
        "--max-tokens", type=int, default=64, help="most new tokens (default: %(default)s)"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)"
    )
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, random)")
    add_option(
        gen,
        "--sparse-top-k",
        help="HiSparse: KV rows each query token attends to, chosen by the indexer (not "
        f"sampling's top-k) (default: the model's index_topk; the demo: {DEMO_TOP_K})",
    )
    add_options(
        gen, "--hot-buffer-rows", "--host-pool-gib", "--offload", "--gpu-memory-gib",
        "--gpu-memory-utilization", "--max-model-len", "--max-num-seqs",
        "--max-num-batched-tokens", "--kv-placement", "--dtype", "--device",
    )  # fmt: skip
    add_parallel_args(gen)
    gen.add_argument(
        "--speculative-config", default=None, help=SPECULATIVE_HELP + " (default: none)"
    )
    gen.set_defaults(handler=run_generate, builds_engine=True)


def run_generate(args: argparse.Namespace) -> int:
    from hisparse.engine.sampling import SamplingParams

    if args.seed is not None and args.temperature == 0:
        # greedy decoding draws no random numbers (SamplingParams.greedy)
        print("note: --seed has no effect with --temperature 0 (greedy decoding)", file=sys.stderr)
    text = read_prompt(args)
    demo = text is None
    top_k = args.sparse_top_k if args.sparse_top_k is not None else (DEMO_TOP_K if demo else None)
    # every flag checked before the model loads
    config = HiSparseConfig(
        top_k=top_k,
        device_buffer_size=args.hot_buffer_rows,
        host_pool_gib=args.host_pool_gib,
        offload=args.offload,
    )
    if config.top_k is not None:
        config.resolve()  # a budget no hot buffer can hold, named before the model loads
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    args.speculative_config = SpeculativeConfig.of(args.speculative_config)
    require_weights(resolve_model_source(args.model, name="--model"), "generate", "--model")
    console = Console()
    try:
        return _generate(args, console, config, params, text)
    except KeyboardInterrupt as err:
        partial = getattr(err, "outputs", None)  # `GenerationInterrupted` from generate()
        if partial:
            console.print(f"[bold]Answer (so far):[/] {partial[0].text.strip()}")
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def read_prompt(args: argparse.Namespace) -> str | None:
    """The user message: ``--prompt``, or ``--prompt-file`` (a file, or ``-``: stdin, read to
    its end), or ``None`` for the demo. An empty message is refused, naming its source."""
    if args.prompt_file is None:
        text, where = args.prompt, "--prompt"
        if text is None:
            return None
    elif args.prompt_file == "-":
        text, where = sys.stdin.read(), "--prompt-file - (stdin)"
    else:
        path = Path(args.prompt_file).expanduser()
        where = f"--prompt-file {args.prompt_file}"
        if path.is_dir():
            raise ValueError(f"{where}: is a folder; give a text file, or - for stdin")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file; give a text file, or - for stdin") from None
        except UnicodeDecodeError as err:
            why = f"{err.reason} at byte {err.start}"
            raise ValueError(f"{where}: not UTF-8 text ({why})") from None
    if not text.strip():
        raise ValueError(f"{where}: the prompt is empty; give the text to answer")
    return text


def _generate(
    args: argparse.Namespace,
    console: Console,
    config: HiSparseConfig,
    params: object,
    text: str | None,
) -> int:
    from hisparse.engine.llm import LLM

    demo = text is None
    t0 = time.perf_counter()
    with loading_display(console, args.model):
        llm = LLM(
            args.model,
            kv_placement=args.kv_placement,
            hisparse=config,
            max_model_len=args.max_model_len,
            gpu_memory_gib=args.gpu_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            **parallel_kwargs(args),
            speculative_config=args.speculative_config,
        )
    load_s = time.perf_counter() - t0
    with llm:
        text = demo_prompt() if demo else text
        if llm.tokenizer is None:
            raise ValueError("this model has no tokenizer; use the Python API with token ids")
        if args.no_chat or llm.chat_template is None:
            ids = llm.encode(text)
        else:
            ids = llm.chat_token_ids([{"role": "user", "content": text}])
        if demo:
            console.print(
                f"[bold]Prompt[/] ({len(ids)} tokens): a passage of the Python "
                f"reference (pydoc_data 'for'), then: {DEMO_QUESTION}"
            )
        clock = kernel_clock(llm)
        with prefill_progress(console, len(ids), args) as on_step, clock or nullcontext():
            (out,) = llm.generate(
                prompt_token_ids=ids, sampling_params=params, use_tqdm=False, on_step=on_step
            )
        if out.error:
            raise ValueError(out.error)
        console.print(f"[bold]Answer:[/] {out.text.strip()}")
        console.print(summary_line(llm, out, load_s, clock) + fp8_report(llm))
    return 0


@contextmanager
def prefill_progress(console: Console, prompt_len: int, args: argparse.Namespace) -> Iterator[Any]:
    """A progress bar of prompt tokens prefilled for a prompt of more than one engine step
    (``--max-num-batched-tokens``), then a spinner while it decodes; a spinner only for a
    short prompt. Yields the ``on_step`` callback for `LLM.generate`."""
    if prompt_len <= args.max_num_batched_tokens:
        with console.status("generating"):
            yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("prefill (prompt tokens)", total=prompt_len)

        def on_step(requests: list[Any]) -> None:
            done = min(max((r.num_computed for r in requests), default=0), prompt_len)
            bar.update(task, completed=done)
            if done >= prompt_len:
                bar.update(task, description="decoding")

        yield on_step


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
    if m.spec_drafted:  # speculative decoding: how the drafts fared
        decode += (f" ({m.spec_accepted} of {m.spec_drafted} drafts accepted, mean accepted "
                   f"length {m.mean_accepted_length:.2f})")  # fmt: skip
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
