"""One cell of ``hisparse bench``: one engine (`_make_llm`) at one concurrency, its requests
run through `generate` and summarized into one table row (throughput, latency, swap counters,
the prefill rate), plus the warm-up that keeps compilation out of the timing. Split from the
command (`hisparse.bench.cli`: arguments and the loop over cells) and its report
(`hisparse.bench.report`).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from hisparse.cli_generate import parallel_kwargs


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(
    steps: list[dict[str, float]],
    outs: list[Any],
    wall: float,
    synthetic: bool,
) -> dict[str, Any]:
    """One table row from a finished `generate` (its outputs and ``LLM.last_run_stats``):
    throughput, latency, swap counters."""
    dec = [s for s in steps if s["decode"]]
    dec_s = sum(s["seconds"] for s in dec)
    pre = [s for s in steps if not s["decode"]]
    dec_tokens = sum(s["tokens"] for s in dec)
    hits = sum(o.metrics.hits for o in outs)
    misses = sum(o.metrics.misses for o in outs)
    nbytes = sum(o.metrics.bytes_swapped for o in outs)
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    peak = max((int(s["running"]) for s in dec), default=0)
    # Requests holding KV at once: a prefill step counts every admitted request (decoding and
    # prefilling), the capacity `hisparse plan` promises; ``peak`` counts decoding ones only,
    # which stays lower when requests finish before the last ones are prefilled.
    held = max((int(s["running"]) for s in steps), default=0)
    # Steady state: decode steps with every admitted request running. The whole-run rate
    # above also counts steps that wait on other requests' (synthetic) prefill work and the
    # ramp while requests are admitted one by one.
    at_peak = [s["tokens"] / s["seconds"] for s in dec if s["running"] == peak and s["seconds"] > 0]
    row: dict[str, Any] = dict(
        requests=len(outs),
        completed=sum(o.ok and len(o.token_ids) > 0 for o in outs),
        errors=[o.error for o in outs if o.error],
        preemptions=sum(o.metrics.preemptions for o in outs),
        peak_running=peak,
        peak_admitted=held,
        decode_steps=len(dec),
        decode_seconds=dec_s,
        decode_tok_s=dec_tokens / dec_s if dec_s > 0 else 0.0,
        peak_decode_tok_s=_percentile(at_peak, 0.5),
        peak_steps=len(at_peak),
        decode_step_ms_p50=_percentile([1e3 * s["seconds"] for s in dec], 0.5),
        decode_step_ms_p95=_percentile([1e3 * s["seconds"] for s in dec], 0.95),
        wall_seconds=wall,
        prefill_seconds=None if synthetic else sum(s["seconds"] for s in pre),
        prefill_tokens=sum(s["tokens"] for s in pre),
        ttft_p50=None if synthetic else _percentile(ttft, 0.5),
        ttft_p95=None if synthetic else _percentile(ttft, 0.95),
        tpot_p50=_percentile(tpot, 0.5),
        tpot_p95=_percentile(tpot, 0.95),
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        bytes_swapped=nbytes,
        h2d_gb_s=nbytes / dec_s / 1e9 if dec_s > 0 else 0.0,
    )
    if dec and "resolve_ms" in dec[0]:
        res = sum(s.get("resolve_ms", 0.0) for s in dec)
        gat = sum(s.get("gather_ms", 0.0) for s in dec)
        row.update(
            resolve_ms_per_step=res / len(dec),
            gather_ms_per_step=gat / len(dec),
            gather_gb_s=nbytes / (gat / 1e3) / 1e9 if gat > 0 else None,
        )
    return row


def _make_llm(args: argparse.Namespace, cfg: dict[str, Any], placement: str) -> Any:
    from hisparse.bench.hooks import BenchHooks
    from hisparse.config import HiSparseConfig
    from hisparse.engine.llm import LLM

    hs = HiSparseConfig(
        top_k=args.sparse_top_k,
        device_buffer_size=args.hot_buffer_rows,
        host_pool_gib=args.host_pool_gib,  # None: the engine's default, sized to the run
        block_size=args.block_size,
        offload=args.offload,
    )
    return LLM(
        args.model,
        kv_placement=placement,
        hisparse=hs,
        max_num_seqs=max(cfg["concurrency"]),
        max_model_len=cfg["max_len"],
        gpu_memory_gib=args.gpu_memory_gib,
        dtype=args.dtype,
        device=args.device,
        kv_format=args.kv_format,
        max_num_batched_tokens=cfg["batched"],
        # speculation runs only without the benchmark-only modes (`parse_args_checked`)
        step_hooks=None
        if cfg.get("spec") is not None
        else BenchHooks(
            topk_overlap=cfg["overlap"],
            synthetic_prefill=args.prefill == "synthetic",
            timing=args.timing,
            seed=args.seed,
        ),
        speculative_config=cfg.get("spec"),
        schedule=args.schedule,
        **parallel_kwargs(args),
        # off unless the prompts share a document (--shared-prefix): cold prefills otherwise
        enable_prefix_caching=bool(getattr(args, "shared_prefix", 0)),
    )


def _warmup_args(
    args: argparse.Namespace, top_k: int, batched: int | None = None
) -> argparse.Namespace:
    """A short run of the same shape class: 2 top_k + 1 prompt tokens, 3 new tokens. With the
    real prefill, a prompt of one whole chunk (``batched`` tokens) so the prefill kernels
    compile for the chunk's shapes outside the timing (Triton specializes on sizes: the
    short prompt alone left the first timed chunk paying for compilation)."""
    short = min(args.input_len, 2 * top_k + 1)
    if batched is not None and args.prefill == "model":
        short = min(args.input_len, max(short, batched))
    return argparse.Namespace(**{**vars(args), "input_len": short, "output_len": 3})


def warmup_batches(llm: Any, n: int) -> list[int]:
    """Batch sizes to warm before a cell of ``n`` requests: every padded decode-graph size up
    to ``n``'s (requests ramp up and drain through the smaller ones), else just ``n``.

    A decode step of a size not yet seen captures a graph (and compiles kernel variants),
    which takes seconds against a step's milliseconds: inside a timed run it dominated the
    whole-run rate. Under
    ``offload="under_pressure"`` the short warm-up requests keep their pages, so each size
    captures both kinds of step (`DecodeGraphs.run`), and a timed step that demotes replays."""
    graphs = getattr(llm.runner, "graphs", None)
    if graphs is None or not graphs.capture:
        return [n]
    top = graphs.padded_size(n)
    return [b for b in graphs.sizes if b < top] + [n]


#: the seed of the document every prompt starts with (``--shared-prefix``)
DOC_SEED = 0x5EED


def _prompts(n: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    """``n`` random prompts; their first ``shared`` tokens one document (the same in every
    cell and warm-up: a seed of its own)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shared = min(shared, length)
    doc = torch.randint(0, vocab, (shared,), generator=torch.Generator().manual_seed(DOC_SEED))
    return [
        doc.tolist() + torch.randint(0, vocab, (length - shared,), generator=g).tolist()
        for _ in range(n)
    ]


def run_cell(
    llm: Any,
    args: argparse.Namespace,
    n: int,
    seed: int,
    on_finish: Any = None,
) -> dict[str, Any]:
    """``n`` requests at once through ``llm`` (its scheduler capped at ``n`` running)."""
    from hisparse.engine.sampling import SamplingParams

    llm.set_max_num_seqs(n)
    shared = getattr(args, "shared_prefix", 0) or 0
    prompts = _prompts(n, args.input_len, llm.model.config.vocab_size, seed, shared)
    llm.reset_prefix_cache()  # every cell prefills the document once (not the warm-up)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    demoted = llm.scheduler.demotions
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, on_finish=on_finish)
    steps = llm.last_run_stats  # every step of this call (step_stats keeps only the latest)
    row = summarize(steps, outs, time.perf_counter() - t0, args.prefill == "synthetic")
    row["token_ids"] = [o.token_ids for o in outs]
    # the first request id of the cell: the top-k replay is keyed by it (`hisparse simulate`)
    row["first_request_id"] = min(int(o.request_id) for o in outs) if outs else None
    row["cached_tokens"] = sum(c.metrics.cached_tokens for o in outs for c in o.outputs)
    metrics = [c.metrics for o in outs for c in o.outputs]
    if any(m.spec_steps for m in metrics):  # speculative decoding: how the drafts fared
        drafted, accepted = (
            sum(getattr(m, k) for m in metrics) for k in ("spec_drafted", "spec_accepted")
        )
        steps_verified = sum(m.spec_steps for m in metrics)
        row.update(
            spec_drafted=drafted,
            spec_accepted=accepted,
            acceptance_rate=accepted / drafted if drafted else None,
            mean_accepted_length=1 + accepted / steps_verified,
        )
    # the host pool the engine sized (its default depends on this machine's memory): what a
    # replay of this run (`hisparse simulate --compare`) must plan with
    pool = llm.kv.layout.host_pool_bytes if llm.kv.hisparse else 0
    row["host_pool_gib"] = pool / 2**30 if pool else None
    if llm.kv.hisparse:  # `HiSparseConfig.offload` and the requests it demoted in this run
        row["offload"] = llm.kv.config.offload
        row["demotions"] = llm.scheduler.demotions - demoted
    # the step-by-step schedule: tokens are comparable across placements only under the same one
    row["schedule"] = [(bool(s["decode"]), int(s["tokens"]), int(s["running"])) for s in steps]
    # every step's kind, batch and time, for reading where a whole run's time went
    row["step_log"] = [
        [int(s["decode"]), int(s["running"]), round(1e3 * s["seconds"], 3)] for s in steps
    ]
    return row


def _prefill_rate(
    llm: Any, row: dict[str, Any], args: argparse.Namespace, cfg: dict[str, Any], rates: dict
) -> dict[str, Any]:
    """Prompt tokens per second of the prefill steps and their FLOPs over the bf16 GEMM rate
    measured on the model's own shapes (`hisparse.bench.prefill_rate`), once per engine."""
    from hisparse.bench.prefill_rate import measured_gemm_rate, prefill_flops

    secs = row["prefill_seconds"]
    if not secs:
        return {}
    if "gemm" not in rates:
        rates["gemm"] = measured_gemm_rate(llm.model, min(cfg["batched"], args.input_len))
    flops = row["requests"] * prefill_flops(llm.model, args.input_len, llm.config.top_k)
    rate = rates["gemm"]
    return dict(
        prefill_tok_s=row["prefill_tokens"] / secs,
        prefill_tflop_s=flops / secs / 1e12,
        gemm_tflop_s=None if rate is None else rate / 1e12,
        prefill_mfu=None if rate is None else flops / secs / rate,
    )
