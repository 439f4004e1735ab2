"""Where a decode step's time goes: eager steps against CUDA-graph steps, both placements.

Builds a ``v32-attention`` checkpoint (`make_tiny`, 4 layers by default) in a temp dir, then for
each placement (HiSparse, all-GPU), decode path (eager, graphs) and batch size runs the engine
with synthetic prefill and top-k replay (overlap 0.8, as ``hisparse bench``) at a long context.
Per run: decode steps ``[0, skip)`` warm up (kernel compilation, graph capture),
``[skip + 1, skip + 1 + active)`` are profiled with torch.profiler (after one profiler warm-up
step), the steps after them are timed unprofiled (their median is the step time reported).

Printed per run: the top ops by self CPU and by self CUDA time, and per profiled step the
host syncs (stream / device / event synchronize calls, ``.item()``-style scalar reads,
``nonzero``), kernel launches (graph launches counted apart), and GPU busy time (union of
kernel and copy intervals in the trace); per timed step the host time from entering the
runner to the graph launch, and the launch call itself. The summary table comes last. Under
``--out`` (or ``$OUT``): ``profile_decode.json`` and ``traces.tar`` (gzipped chrome traces).

    PYTHONPATH=src python3 benchmarks/profile_decode.py            # H200 defaults
    PYTHONPATH=src python3 benchmarks/profile_decode.py --device cpu --preset tiny \\
        --kv-format bf16 --context 100 --batches 1,2 --output 10 --skip 2 --active 2   # smoke test
"""

from __future__ import annotations

import argparse
import collections
import gzip
import io
import itertools
import json
import os
import statistics
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous copy (the async one is cudaMemcpyAsync)
)
SCALAR_READS = ("aten::_local_scalar_dense", "aten::nonzero")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="deepseek_v32", choices=("deepseek_v32", "glm_moe_dsa"))
    p.add_argument("--preset", default="v32-attention", choices=("v32-attention", "tiny"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an existing checkpoint dir or .gguf file (default: build --preset)",
    )
    p.add_argument("--top-k", type=int, default=None, help="HiSparseConfig.top_k")
    p.add_argument(
        "--real-prefill",
        action="store_true",
        help="run the prompts through the model instead of the synthetic prefill",
    )
    p.add_argument(
        "--host-pool-gib",
        type=float,
        default=None,
        help="host pool (default: sized from the checkpoint's MLA rows)",
    )
    p.add_argument("--context", type=int, default=32000, help="prompt tokens per request")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--placements", default="hisparse,gpu")
    p.add_argument("--paths", default="eager,graphs", help="decode paths: eager, graphs")
    p.add_argument("--output", type=int, default=28, help="new tokens per request")
    p.add_argument("--skip", type=int, default=4, help="decode steps before profiling")
    p.add_argument("--active", type=int, default=4, help="profiled decode steps")
    p.add_argument(
        "--overlap",
        type=float,
        default=0.8,
        help="top-k replay overlap; <= 0: the model's own indexer chooses",
    )
    p.add_argument("--gpu-memory-gib", type=float, default=8.0)
    p.add_argument(
        "--async-scheduling",
        choices=("on", "off"),
        default="on",
        help="LLM(async_scheduling=): decodes launched before the last one's tokens "
        "are read (step ms: the interval between consecutive steps' tokens)",
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-format", default="auto", help="fp8_ds_mla (auto), bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--top-ops", type=int, default=12)
    p.add_argument("--top-kernels", type=int, default=40, help="kernel names listed per run")
    p.add_argument("--out", type=Path, default=None, help="default: $OUT, else a temp dir")
    args = p.parse_args()
    if args.output < args.skip + args.active + 3:
        p.error("--output must exceed --skip + --active + 2 (timed steps follow the profile)")
    return args


def build_checkpoint(args: argparse.Namespace, where: Path) -> Path:
    from hisparse.models.tiny import make_tiny

    if args.model is not None:
        return args.model
    path = where / f"{args.arch}-{args.preset}-{args.layers}l"
    make_tiny(args.arch, path, preset=args.preset, seed=0, num_hidden_layers=args.layers)
    return path


def make_llm(args: argparse.Namespace, ckpt: Path, placement: str, max_batch: int) -> Any:
    from hisparse import HiSparseConfig
    from hisparse.bench.hooks import BenchHooks
    from hisparse.engine.llm import LLM
    from hisparse.kv.row_formats import mla_row_bytes

    max_len = args.context + args.output + args.block_size
    host_gib = args.host_pool_gib
    gguf = ckpt.suffix == ".gguf"  # a Llama (GQA) model: its own prefill, no bench hooks
    if host_gib is None and gguf:
        host_gib = 4.0
    if host_gib is None:
        cfg = json.loads((ckpt / "config.json").read_text())
        fmt = "fp8_ds_mla" if args.kv_format == "auto" else args.kv_format
        row = mla_row_bytes(fmt, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
        host_gib = 1.2 * max_batch * (max_len + args.block_size) * row * args.layers / 2**30 + 0.05
    return LLM(
        ckpt,
        kv_placement=placement,
        hisparse=HiSparseConfig(
            host_pool_gib=host_gib, block_size=args.block_size, top_k=args.top_k
        ),
        max_num_seqs=max_batch,
        max_model_len=max_len,
        gpu_memory_gib=args.gpu_memory_gib,
        device=args.device,
        kv_format=args.kv_format,
        max_num_batched_tokens=max_batch * max_len,  # every prompt in one prefill step
        enable_prefix_caching=False,  # the host pool above is sized for rows only
        step_hooks=None
        if gguf
        else BenchHooks(
            topk_overlap=args.overlap if args.overlap > 0 else None,
            synthetic_prefill=not args.real_prefill,
        ),
        cuda_graphs=True,
        async_scheduling=args.async_scheduling == "on",
    )


def set_path(llm: Any, path: str) -> None:
    """Switch the runner's decode path (one model load serves both paths): ``eager`` drops
    the graphs object, ``graphs`` restores it (graphs already captured stay valid)."""
    runner = llm.runner
    if not hasattr(runner, "_saved_graphs"):
        runner._saved_graphs = runner.graphs
    runner.graphs = None if path == "eager" else runner._saved_graphs
    runner.decode_path = path


def busy_ms(trace: dict[str, Any]) -> float:
    """Union of GPU kernel / copy / memset intervals in a chrome trace, in ms."""
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    total, end = 0.0, float("-inf")
    for s, t in spans:
        if t <= end:
            continue
        total += t - max(s, end)
        end = t
    return total / 1e3


def profile_run(
    args: argparse.Namespace, llm: Any, batch: int, tag: str, out: Path
) -> dict[str, Any]:
    from hisparse.engine.sampling import SamplingParams

    llm._ids = itertools.count()  # same request ids (keys of synthetic rows, replay) per run
    vocab = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (args.context,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    cuda = llm.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sched = schedule(wait=args.skip, warmup=1, active=args.active, repeat=1)
    trace_file = Path(tempfile.mkdtemp(prefix="trace_")) / f"trace_{tag}.json"
    prof = profile(activities=acts, schedule=sched)
    runner = llm.runner
    orig = runner.run
    decode_steps = [0]
    profiled = args.skip + 1 + args.active  # decode steps inside the profiler's window
    # Host timings of the unprofiled steps: entering the runner, the graph replay call.
    enter: list[float] = []
    replays: list[tuple[float, float]] = []
    graph_cls = torch.cuda.CUDAGraph
    orig_replay = graph_cls.replay

    def replay(self):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        orig_replay(self)
        replays.append((t, time.perf_counter()))

    def run(batch_, *, decode, finishing, **kw):  # type: ignore[no-untyped-def]
        if decode:
            enter.append(time.perf_counter())
        res = orig(batch_, decode=decode, finishing=finishing, **kw)
        if decode:
            if cuda and decode_steps[0] <= profiled:
                torch.cuda.synchronize()  # step boundaries in the trace are real
            decode_steps[0] += 1
            if decode_steps[0] <= profiled + 1:
                prof.step()
        return res

    runner.run = run
    graph_cls.replay = replay
    t0 = time.perf_counter()
    try:
        with prof:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        runner.run = orig
        graph_cls.replay = orig_replay
    wall = time.perf_counter() - t0
    assert all(o.ok for o in outs), [o.error for o in outs]
    stats = [s for s in llm.last_run_stats if s["decode"]]
    timed = [s for i, s in enumerate(stats) if i >= args.skip + 1 + args.active + 1]
    timed = [s for s in timed if int(s["running"]) == batch] or timed
    ms = [1e3 * s["seconds"] for s in timed]
    # per timed step: host time from entering the runner to the graph launch, and the launch
    first = len(stats) - len(timed)
    pre, launch = [], []
    for i in range(first, len(stats)):
        if i < len(enter):
            later = [r for r in replays if r[0] >= enter[i]]
            if later and (i + 1 >= len(enter) or later[0][0] < enter[i + 1]):
                pre.append(1e3 * (later[0][0] - enter[i]))
                launch.append(1e3 * (later[0][1] - later[0][0]))
    prof.export_chrome_trace(str(trace_file))
    raw = trace_file.read_bytes()
    trace = json.loads(raw)
    # one uncompressed tar of gzipped traces, appended run by run (survives a cut-off run)
    with tarfile.open(out / "traces.tar", "a") as tar:
        info = tarfile.TarInfo(f"{trace_file.name}.gz")
        data = gzip.compress(raw)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    trace_file.unlink()
    ka = prof.key_averages()
    n = max(args.active, 1)
    kernel_names = collections.Counter(
        e["name"][:90] for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"
    )

    def count(names: tuple[str, ...]) -> float:
        return sum(e.count for e in ka if e.key in names) / n

    device_key = (
        "self_device_time_total"
        if hasattr(ka[0], "self_device_time_total")
        else ("self_cuda_time_total")
    )
    top_cpu = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top_ops]
    top_dev = sorted(ka, key=lambda e: getattr(e, device_key, 0), reverse=True)[: args.top_ops]
    hits = sum(o.metrics.hits for o in outs)
    misses = sum(o.metrics.misses for o in outs)
    # the swap-in's bytes per decode step (every step of the run), and what crossing the host
    # link at its bulk rate would take: issue #21's "HiSparse likewise, plus its swap-in"
    swap_mb = sum(o.metrics.bytes_swapped for o in outs) / max(len(stats), 1) / 1e6
    copy = hbm_copy_gbps() if cuda else None
    h2d = h2d_copy_gbps() if cuda and swap_mb > 0 else None
    roof = roofline_ms(llm, batch, args.context, copy) if copy else None
    swap_ms = swap_mb / h2d if h2d else 0.0
    row = dict(
        tag=tag,
        batch=batch,
        decode_steps=len(stats),
        timed_steps=len(ms),
        step_ms_median=statistics.median(ms) if ms else None,
        step_ms_min=min(ms) if ms else None,
        step_ms_max=max(ms) if ms else None,
        host_to_launch_ms=statistics.median(pre) if pre else None,
        graph_launch_ms=statistics.median(launch) if launch else None,
        gpu_busy_ms_per_step=busy_ms(trace) / n if cuda else None,
        gpu_kernels_per_step=sum(
            1 for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"
        )
        / n,
        syncs_per_step=count(SYNC_CALLS),
        scalar_reads_per_step=count(SCALAR_READS),
        launches_per_step=count(LAUNCHES),
        graph_launches_per_step=count(GRAPH_LAUNCHES),
        kernels_by_name=[(k, c / n) for k, c in kernel_names.most_common(args.top_kernels)],
        copy_gbps=copy,
        roofline_ms=roof,
        swap_mb_per_step=swap_mb,
        h2d_gbps=h2d,
        swap_ms_at_h2d=swap_ms,
        roofline_with_swap_ms=roof + swap_ms if roof else None,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        wall_s=wall,
        # (padded size, every page resident) of each captured graph
        graphs_captured=sorted(runner.graphs.graphs) if runner.graphs is not None else [],
        top_self_cpu=[(e.key, e.count, e.self_cpu_time_total / n / 1e3) for e in top_cpu],
        top_self_cuda=[(e.key, e.count, getattr(e, device_key, 0) / n / 1e3) for e in top_dev],
        tokens=[o.token_ids for o in outs],
    )
    print(f"\n=== {tag}: {len(ms)} timed decode steps, median {row['step_ms_median']} ms ===")
    print(
        f"per profiled step: syncs {row['syncs_per_step']:.1f}, scalar reads "
        f"{row['scalar_reads_per_step']:.1f}, kernel launches {row['launches_per_step']:.1f}, "
        f"graph launches {row['graph_launches_per_step']:.1f}, GPU busy "
        f"{row['gpu_busy_ms_per_step']} ms, GPU kernels {row['gpu_kernels_per_step']:.0f}"
    )
    print("top self CPU (ms per step, calls in window):")
    for k, c, t in row["top_self_cpu"]:
        print(f"  {t:9.3f}  {c:6d}  {k[:100]}")
    if cuda:
        print("top self CUDA (ms per step, calls in window):")
        for k, c, t in row["top_self_cuda"]:
            print(f"  {t:9.3f}  {c:6d}  {k[:100]}")
        print("kernels per step by name:")
        for k, c in row["kernels_by_name"]:
            print(f"  {c:7.1f}  {k}")
    return row


def hbm_copy_gbps() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy, measured afresh at
    each call (each profiled batch), so a row's roofline uses the rate beside its own steps:
    the median of `triton.testing.do_bench` (back-to-back copies, as the kernel benchmarks
    time theirs; one event-timed copy at a time read 1-9% slower)."""
    import triton.testing

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() / ms / 1e6


def h2d_copy_gbps() -> float:
    """Bytes per second of a 256 MiB pinned host to device copy (median of 10 after 2): the
    rate at which a swap-in's bytes could at best cross the host link."""
    a = torch.empty(2**28, dtype=torch.uint8, pin_memory=True)
    b = torch.empty(a.shape, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a, non_blocking=True)
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) / 1e3)
    return a.numel() / statistics.median(times) / 1e9


def roofline_ms(llm: Any, batch: int, context: int, gbps: float) -> float:
    """The step's must-read bytes at the copy rate ``gbps``: every weight but the embedding,
    each request's indexer keys (full-indexer layers) and its top-k MLA rows (every layer)."""
    from hisparse.kv.row_formats import mla_row_bytes

    model = llm.model
    cfg = model.config
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= embed.numel() * embed.element_size()
    if not hasattr(cfg, "kv_lora_rank"):  # GQA: the top-k K+V rows of every layer
        top_k = llm.runner.config.top_k or context
        rows = llm.runner.row_format.row_bytes * min(top_k, context) * cfg.num_hidden_layers
        return (weights + batch * rows) / (gbps * 1e9) * 1e3
    row = mla_row_bytes(llm.runner.row_format, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    idx = model.indexer_format.row_bytes * context * sum(cfg.indexer_full)
    mla = row * min(cfg.index_topk, context) * cfg.num_hidden_layers
    return (weights + batch * (idx + mla)) / (gbps * 1e9) * 1e3


def main() -> int:
    args = parse_args()
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="profile_decode_"))
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    results: list[dict[str, Any]] = []
    (out / "traces.tar").unlink(missing_ok=True)
    meta = dict(vars(args), out=str(out), model=str(args.model), torch=torch.__version__)
    if torch.cuda.is_available() and (args.device or "cuda") == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ckpt = build_checkpoint(args, Path(tmp))
        print(f"checkpoint {ckpt.name} written in {time.perf_counter() - t0:.1f} s")
        for placement in args.placements.split(","):
            t0 = time.perf_counter()
            llm = make_llm(args, ckpt, placement, max(batches))
            print(f"{placement}: engine up in {time.perf_counter() - t0:.1f} s")
            try:
                for path in paths:
                    set_path(llm, path)
                    for batch in batches:
                        tag = f"{placement}_{path}_b{batch}"
                        try:
                            results.append(
                                dict(placement=placement, path=path,
                                     **profile_run(args, llm, batch, tag, out))
                            )  # fmt: skip
                        except Exception as exc:  # report and go on
                            traceback.print_exc()
                            results.append(dict(placement=placement, path=path, tag=tag,
                                                batch=batch, error=repr(exc)))  # fmt: skip
                        (out / "profile_decode.json").write_text(
                            json.dumps(dict(meta=meta, results=results), indent=1)
                        )
            finally:
                llm.close()
                del llm
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    # same tokens across paths (and placements) under the same schedule
    by_key: dict[int, list[Any]] = {}
    for r in results:
        if "tokens" in r:
            by_key.setdefault(r["batch"], []).append(r["tokens"])
    same = {b: all(t == ts[0] for t in ts) for b, ts in by_key.items()}
    print("\nsame tokens across placements and paths, per batch:", same)
    print(
        "\n| placement | path | batch | step ms (median) | min | max | GPU busy ms/step | "
        "host to launch ms | graph launch ms | syncs/step | scalar reads/step | launches/step | "
        "graph launches/step | hit rate | GPU kernels/layer | copy GB/s | roofline ms | "
        "step / roofline | swap MB/step | + swap ms | step / (roofline + swap) |"
    )
    print("|---" * 21 + "|")

    def f(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    for r in results:
        if "error" in r:
            print(f"| {r['placement']} | {r['path']} | {r['batch']} | error: {r['error'][:60]} |")
            continue
        print(
            f"| {r['placement']} | {r['path']} | {r['batch']} | {f(r['step_ms_median'])} | "
            f"{f(r['step_ms_min'])} | {f(r['step_ms_max'])} | {f(r['gpu_busy_ms_per_step'])} | "
            f"{f(r['host_to_launch_ms'], '.3f')} | {f(r['graph_launch_ms'], '.3f')} | "
            f"{f(r['syncs_per_step'], '.1f')} | {f(r['scalar_reads_per_step'], '.1f')} | "
            f"{f(r['launches_per_step'], '.0f')} | {f(r['graph_launches_per_step'], '.1f')} | "
            f"{f(r['hit_rate'], '.3f')} | {r['gpu_kernels_per_step'] / args.layers:.0f} | "
            f"{f(r['copy_gbps'], '.0f')} | {f(r['roofline_ms'], '.3f')} | "
            f"{f(r['step_ms_median'] / r['roofline_ms'] if r['roofline_ms'] else None)} | "
            f"{f(r['swap_mb_per_step'], '.1f')} | {f(r['swap_ms_at_h2d'], '.3f')} | "
            f"{f(r['step_ms_median'] / rs if (rs := r['roofline_with_swap_ms']) else None)} |"
        )
    for b in batches:
        for path in paths:
            m = {r["placement"]: r.get("step_ms_median") for r in results
                 if r["batch"] == b and r["path"] == path}  # fmt: skip
            if m.get("hisparse") and m.get("gpu"):
                print(f"batch {b}, {path}: HiSparse / all-GPU step time = "
                      f"{m['hisparse'] / m['gpu']:.3f}")  # fmt: skip
    print(f"\nJSON and traces under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
