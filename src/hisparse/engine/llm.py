"""`hisparse.LLM`: load a checkpoint and generate, with the KV cache in the HiSparse host
pool (``kv_placement="hisparse"``) or every row on the GPU (``kv_placement="gpu"``).

The sparse-attention settings (top_k, indexer) apply to both placements; ``kv_placement``
changes only where the KV rows live, so both give the same tokens.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from hisparse.config import HiSparseConfig, check_gib
from hisparse.engine.kv_manager import KVCacheManager
from hisparse.engine.model_runner import ModelRunner, ReplaySettings, engine_specs
from hisparse.engine.request import Request, RequestOutput, Status
from hisparse.engine.sampling import SamplingParams, sample
from hisparse.engine.scheduler import SCHEDULE_POLICIES, ScheduledStep, Scheduler
from hisparse.models.loader import load_dsa_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PLACEMENTS = ("hisparse", "gpu")
#: top_k of GQA models, which declare none: the smallest budget that kept needle retrieval equal
#: to dense in docs/quality.md (2K, 4K and 8K contexts).
DEFAULT_GQA_TOP_K = 256


def indexer_method(indexer: str) -> str:
    """DSA indexer modes map onto the GQA scorer: fp8 keys for either."""
    return "fp8" if indexer in ("fp8", "exact") else indexer


def _resolve_model(model: str | Path) -> Path:
    """A checkpoint directory (config.json), a ``.gguf`` file, or ``smollm2``."""
    text = str(model)
    if text.lower() in ("smollm2", "smollm2-135m-instruct") or text.endswith(".gguf"):
        from hisparse.models.smollm2 import resolve_model_path

        return resolve_model_path(model)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {text!r}: no config.json there. Pass a checkpoint directory "
            "(config.json + *.safetensors) of a deepseek_v32 / glm_moe_dsa model, a .gguf "
            "file of a Llama model, or 'smollm2' (the bundled SmolLM2-135M-Instruct)."
        )
    return path


class LLM:
    """A model plus its engine.

    Args:
        model: a checkpoint directory (``config.json`` + safetensors) of a ``deepseek_v32`` or
            ``glm_moe_dsa`` model, a Llama ``.gguf`` file, or ``"smollm2"`` (bundled).
        kv_placement: ``"hisparse"`` (host pool + GPU hot buffers) or ``"gpu"``.
        hisparse: HiSparse settings; ``top_k`` defaults to the model's ``index_topk``.
        max_num_seqs: most requests running at once.
        max_model_len: most tokens of one request (prompt + output); default: the model's.
        gpu_memory_gib: GPU (or, on a CPU run, device) memory for the KV cache.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on the CPU), ``"float32"``, ``"bfloat16"``.
        device: ``"cuda"``/``"cpu"``; default CUDA when available.
        kv_format: row format: DSA ``"fp8_ds_mla"`` (auto), ``"bf16"``, ``"fp32"``; GQA
            ``"bf16"``/``"fp32"`` (auto: the model dtype).
        indexer: ``"fp8"`` (DeepSeek's quantized scoring, 132 B keys) or ``"exact"``.
        topk_replay: benchmark only: replace every decode top-k by replayed selections with
            this step-to-step overlap (`hisparse.engine.replay`); both placements alike.
        synthetic_prefill: benchmark only: fill prompts' KV rows and indexer keys with
            pseudo-random valid rows instead of running the prefill (DSA models; time to
            first token is then meaningless; without ``topk_replay`` no prefill selection
            warms the hot buffers, so the first decode step misses every row).
        timing: record resolve / gather time of every decode step (CUDA events, read at the
            end of `generate`) into ``step_stats``. The events cannot live in a CUDA graph: with
            timing, decode runs the graphs' fixed-shape step eagerly (in both placements).
        seed: seed of the replayed selections and synthetic rows.
        cuda_graphs: decode batches padded to a captured size (1, 2, 4, ..., max_num_seqs)
            and replayed as CUDA graphs, swap-in (resolve + gathers) inside the graph,
            sampling outside. Default: on for CUDA, off (the plain eager step) on the CPU;
            ``True`` on the CPU runs the same padded fixed-shape step without capture. Where
            a part of the step cannot be captured (`capture_blockers`: a PyTorch reference
            backend, the quest indexer) the default runs that step without graphs and warns;
            ``True`` is then an error.
        schedule: ``"mixed"`` (default): every step runs the decoding requests' next tokens
            first and fills the rest of ``max_num_batched_tokens`` with prompt chunks;
            ``"prefill-first"``: prompt chunks run alone while any prompt is unfinished.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        kv_placement: str = "hisparse",
        hisparse: HiSparseConfig | None = None,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        gpu_memory_gib: float | None = None,
        dtype: str = "auto",
        device: str | None = None,
        kv_format: str = "auto",
        indexer: str = "fp8",
        max_num_batched_tokens: int = 2048,
        topk_replay: float | None = None,
        synthetic_prefill: bool = False,
        timing: bool = False,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        schedule: str = "mixed",
    ) -> None:
        if schedule not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULE_POLICIES}.")
        if kv_placement not in PLACEMENTS:
            raise ValueError(f"kv_placement={kv_placement!r}: use one of {PLACEMENTS}.")
        if max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1 (prompt tokens "
                "one prefill step may compute)."
            )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1.")
        self.device = _checked_device(device)
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        elif dtype in _DTYPES:
            torch_dtype = _DTYPES[dtype]
        else:
            raise ValueError(f"dtype={dtype!r}: use 'auto' or one of {sorted(_DTYPES)}.")
        hs = hisparse or HiSparseConfig()
        path = _resolve_model(model)
        row_format: object
        if path.suffix == ".gguf":
            # A GQA model (SmolLM2 by default): training-free indexer, K+V rows.
            from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
            from hisparse.models.gguf_loader import load_llama_gguf
            from hisparse.models.tokenizer import GgufTokenizer

            self.config = hs.resolve(model_top_k=DEFAULT_GQA_TOP_K)
            self.model = load_llama_gguf(
                path,
                dtype=torch_dtype,
                device=self.device,
                indexer=GqaIndexerConfig(top_k=self.config.top_k, method=indexer_method(indexer)),
            )
            self.tokenizer = GgufTokenizer.from_gguf(path)
            self.eos_token_ids = set(self.tokenizer.stop_token_ids)
            kv_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(kv_format, torch_dtype)
            row_format = self.model.config.row_format(kv_dtype)
            model_max_len = self.model.config.max_position_embeddings
        else:
            self.model = load_dsa_model(
                path, dtype=torch_dtype, device=self.device, indexer_mode=indexer
            )
            mcfg = self.model.config
            self.config = hs.resolve(model_top_k=mcfg.index_topk)
            if self.config.top_k != mcfg.index_topk:
                # The sparse-attention budget applies to both placements alike.
                _set_index_topk(self.model, self.config.top_k)
            self.tokenizer = _load_tokenizer(path)
            self.eos_token_ids = _eos_ids(path, mcfg)
            row_format = "fp8_ds_mla" if kv_format == "auto" else kv_format
            model_max_len = mcfg.max_position_embeddings
        self.max_model_len = max_model_len or model_max_len
        if gpu_memory_gib is None:
            gpu_memory_gib = _default_kv_gib(self.device)
        check_gib("gpu_memory_gib", gpu_memory_gib)
        specs = engine_specs(self.model, row_format, self.config.block_size)
        self.kv = KVCacheManager(
            specs,
            self.config,
            placement=kv_placement,
            gpu_budget_bytes=int(gpu_memory_gib * 2**30),
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            device=self.device,
        )
        try:
            self.runner = ModelRunner(
                self.model,
                self.config,
                self.kv,
                specs,
                row_format=row_format,
                max_num_seqs=max_num_seqs,
                device=self.device,
                replay=None if topk_replay is None else ReplaySettings(topk_replay, seed),
                synthetic_prefill=synthetic_prefill,
                timing=timing,
                decode_path=_decode_path(cuda_graphs, self.device, indexer),
            )
        except BaseException:
            self.kv.close()  # the process's one host pool: a later LLM() must get it
            raise
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=schedule,
        )
        self._ids = itertools.count()
        self.step_stats: list[dict[str, float]] = []

    # ------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        progress: bool = False,
        on_finish: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A bad prompt gets an error in
        its own output; the other prompts run as usual. ``on_finish(done, total)`` is called
        whenever requests finish (progress displays)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        n = len(prompts) if prompts is not None else len(prompt_token_ids or [])
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * n
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        requests = []
        for i in range(n):
            text = prompts[i] if prompts is not None else None
            req = Request(
                req_id=str(next(self._ids)), prompt_token_ids=[], params=params[i], prompt=text
            )
            error = self._tokenize(req, text, prompt_token_ids[i] if prompt_token_ids else None)
            if error:
                req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
            requests.append(req)
        # Queued only once every prompt was read: nothing of this call is left behind if
        # reading one fails.
        for req in requests:
            if not req.finished:
                self.scheduler.add(req)
        try:
            with _young_objects_only(self.device):
                self._run(requests, progress, on_finish)
        except BaseException:
            # Whatever stopped the run (an error, Ctrl-C), the engine stays usable: this
            # call's unfinished requests leave the scheduler and give their blocks back.
            for req in requests:
                if not req.finished:
                    self.scheduler.abort(req)
            raise
        return [
            RequestOutput(
                req_id=r.req_id,
                prompt=r.prompt,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.output_token_ids),
                text=r.text,
                finish_reason=r.finish_reason,
                error=r.error,
                metrics=r.metrics,
            )
            for r in requests
        ]

    def _tokenize(self, req: Request, text: str | None, ids: Sequence[int] | None) -> str | None:
        if text is not None:
            if self.tokenizer is None:
                return "this checkpoint has no tokenizer.json; pass prompt_token_ids instead"
            encoded = self.tokenizer.encode(text)
            ids = getattr(encoded, "ids", encoded)  # tokenizers.Encoding or a plain list
        assert ids is not None
        try:
            ids = [operator.index(t) for t in ids]
        except TypeError:
            return "the prompt's token ids must be integers"
        vocab = self.model.config.vocab_size
        if not ids:
            return "the prompt is empty; give at least one token"
        if any(t < 0 or t >= vocab for t in ids):
            return f"the prompt has token ids outside the vocabulary [0, {vocab})"
        if len(ids) >= self.max_model_len:
            return (
                f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves "
                "no room for output. Shorten the prompt or raise max_model_len."
            )
        req.prompt_token_ids = ids
        return None

    def _run(
        self,
        requests: list[Request],
        progress: bool,
        on_finish: Callable[[int, int], None] | None = None,
    ) -> None:
        sched = self.scheduler
        bar = _progress(len(requests), progress)
        done = sum(r.finished for r in requests)
        stalls = 0
        first_stat = len(self.step_stats)
        while sched.has_work:
            parts = sched.schedule()
            if not parts:
                stalls += 1
                if stalls > len(requests) + 2:
                    raise RuntimeError("scheduler stalled: nothing fits and nothing runs")
                continue
            stalls = 0
            for part in parts:
                self._run_part(part)
            new_done = sum(r.finished for r in requests)
            if bar is not None and new_done > done:
                bar.update(new_done - done)
            if on_finish is not None and new_done > done:
                on_finish(new_done, len(requests))
            done = new_done
        sched.failed.clear()
        # per-request and per-step swap counters, read from the device once per run
        decode_stats = iter(self.runner.flush_metrics())
        for row in self.step_stats[first_stat:]:
            if row["decode"]:
                row.update(next(decode_stats, {}))
        if bar is not None:
            bar.close()

    def _run_part(self, step: ScheduledStep) -> None:
        """One forward (the decode or the prefill part of an engine step) and what follows
        it: sampled tokens, stops, status, and the resident pages a request no longer needs."""
        sched = self.scheduler
        t0 = time.perf_counter()
        result = self.runner.run(step.batch, decode=step.decode, finishing=step.finishing)
        if result.token_ids is not None:
            tokens = result.token_ids
        else:
            assert result.logits is not None or not result.sample_reqs
            tokens = (
                sample(
                    result.logits,
                    [r.params for r in result.sample_reqs],
                    [r.generator for r in result.sample_reqs],
                )
                if result.sample_reqs
                else []
            )
        now = time.perf_counter()
        for req, n in step.batch:
            req.num_computed += n
        for req, tok in zip(result.sample_reqs, tokens, strict=True):
            if tok is None:
                req.metrics.finished = now
                sched.fail_running(
                    req, "sampling failed: this request's logits are not finite numbers"
                )
                continue
            self._append(req, tok, now)
        if not step.decode:
            for (req, _), fin in zip(step.batch, step.finishing, strict=True):
                if fin and not req.finished:
                    req.status = Status.DECODING
        for (req, _), fin in zip(step.batch, step.finishing, strict=True):
            if not req.finished and (step.decode or fin):
                # the rows are on the host: keep only the tail pages resident
                dropped = self.kv.trim_resident(req.req_id, req.num_computed)
                self.runner.write_back(dropped, req)
                self.kv.release_resident(req.req_id, dropped)
        self.step_stats.append(
            dict(
                decode=float(step.decode),
                tokens=sum(n for _, n in step.batch),
                running=len(step.batch) if step.decode else len(sched.running),
                seconds=now - t0,
                end=now,
            )
        )

    def _append(self, req: Request, token: int, now: float) -> None:
        req.output_token_ids.append(token)
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.metrics.token_times.append(now)
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        p = req.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif p.stop and any(s in req.text for s in p.stop):
            cut = min(req.text.index(s) for s in p.stop if s in req.text)
            req.text = req.text[:cut]
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            req.metrics.finished = now
            self.scheduler.finish(req, reason)

    def close(self) -> None:
        self.kv.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _young_objects_only(device: torch.device) -> Iterator[None]:
    """On the CPU: the objects that exist when a call starts (model, caches, everything
    loaded) are frozen (`gc.freeze`) for the call, so the cyclic collector's full passes
    during it walk only the call's own objects. Measured on SmolLM2 (batch 1): a full pass
    over the loaded process took ~125 ms, about once per 32-token decode, i.e. ~4 ms a
    token. Unfrozen after the call (nothing is kept from the collector for longer); left
    alone where something else froze objects, and on CUDA."""
    if device.type != "cpu" or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def capture_blockers(device: torch.device, indexer: str) -> list[str]:
    """Why a decode step on ``device`` could not be captured as a CUDA graph: the parts that
    would read device values on the host (the PyTorch references, the quest indexer)."""
    from hisparse.runtime.ops import cpu_ops, ops_for, reference

    out = []
    if ops_for(device) in (reference, cpu_ops):
        out.append("the data-plane ops are not the Triton kernels (HISPARSE_OPS, or no Triton)")
    for var in ("HISPARSE_INDEXER", "HISPARSE_ATTENTION"):
        if os.environ.get(var) == "reference":
            out.append(f"{var}=reference")
    if indexer == "quest":
        out.append("indexer='quest' reads page bounds on the host")
    return out


def _decode_path(cuda_graphs: bool | None, device: torch.device, indexer: str = "fp8") -> str:
    """`ModelRunner` decode path for the ``cuda_graphs`` argument on ``device``: CUDA graphs by
    default on CUDA, unless a part of the step cannot be captured (then the same fixed-shape
    step runs eagerly, with a warning; asking for graphs explicitly is then an error)."""
    if cuda_graphs is False or (cuda_graphs is None and device.type != "cuda"):
        return "eager"
    if device.type != "cuda":
        return "padded"  # cuda_graphs=True on the CPU: the graphs' step, run eagerly
    blockers = capture_blockers(device, indexer)
    if not blockers:
        return "graphs"
    why = "; ".join(blockers)
    if cuda_graphs is True:
        raise ValueError(
            f"cuda_graphs=True: the decode step cannot be captured ({why}); pass "
            "cuda_graphs=False, or leave it unset to run the same step without graphs."
        )
    warnings.warn(f"decode runs without CUDA graphs: {why}", stacklevel=3)
    return "padded"


def _set_index_topk(model: torch.nn.Module, top_k: int) -> None:
    for module in model.modules():
        if module.__class__.__name__ == "Indexer":
            module.topk = top_k  # type: ignore[assignment]


def _checked_device(device: str | None) -> torch.device:
    """``device`` (default: CUDA when there is one, else the CPU), or a clear ValueError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: use 'cpu' or 'cuda[:N]'.") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: hisparse runs on 'cpu' or 'cuda[:N]'.")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}, but this PyTorch sees no CUDA device; use device='cpu'."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}, but there are {torch.cuda.device_count()} CUDA devices."
            )
    return dev


def _default_kv_gib(device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.85 * free / 2**30
    return 1.0


def _load_tokenizer(path: Path):
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _eos_ids(path: Path, mcfg: object) -> set[int]:
    eos = getattr(mcfg, "eos_token_id", None)
    if eos is None:
        import json

        cfg = json.loads((path / "config.json").read_text())
        eos = cfg.get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
