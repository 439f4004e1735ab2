"""`hisparse.LLM`: load a checkpoint and generate, with the KV cache in the HiSparse host
pool (``kv_placement="hisparse"``) or every row on the GPU (``kv_placement="gpu"``).

The sparse-attention settings (top_k, indexer) apply to both placements; ``kv_placement``
changes only where the KV rows live, so both give the same tokens.

``tensor_parallel_size=N`` shards the model over N ranks (`hisparse.parallel`,
docs/design.md §18): this object is rank 0, the driver, and sends every request, abort and
step to the other ranks, which run the same engine on their shards.

Every argument is checked before anything is loaded (`hisparse.validation`); a constructor
that fails releases what it took; `LLM.close` releases the host pool, the device pools and
the model at once, and the closed object refuses further use.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hisparse.config import HiSparseConfig
from hisparse.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from hisparse.engine import dp_core
from hisparse.engine.async_core import AsyncEngineCore
from hisparse.engine.core import (
    STEP_STATS_KEPT,
    EngineCore,
    run_with_progress,
    young_objects_only,
)
from hisparse.engine.device import (
    check_device_memory,
    checked_device,
    decode_path,
    default_host_pool_bytes,
    default_kv_gib,
    host_sharing,
)
from hisparse.engine.hooks import StepHooks
from hisparse.engine.inputs import (
    GenerationInterrupted,
    completions,
    never_runs,
    outputs_of,
    params_per_prompt,
    prompt_ids,
    render_chat,
    text_inputs,
    token_inputs,
)
from hisparse.engine.kv_manager import KVCacheManager
from hisparse.engine.llm_args import check_llm_args
from hisparse.engine.model_runner import ModelRunner
from hisparse.engine.output_processor import OutputProcessor
from hisparse.engine.request import Request, RequestOutput
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.speculative import SpeculativeConfig
from hisparse.engine.tp_follower import (
    serve_torchrun_ranks,
    tensor_parallel_state,
    worker_main,
)
from hisparse.engine.v4_step_cache import check_v4_arguments
from hisparse.models.registry import (
    DSA_INDEXERS,
    GQA_KV_FORMATS,
    engine_specs,
    is_gguf,
    is_v4,
    load_model,
    resolve_model,
)
from hisparse.parallel.group import TPGroup
from hisparse.parallel.shard import check_before_ranks, check_tensor_parallel_size
from hisparse.validation import (
    _fail,
    check_bool,
    check_choice,
    check_conversations,
    check_int,
    check_max_model_len,
)

__all__ = ["LLM", "STEP_STATS_KEPT", "GenerationInterrupted"]


class LLM:
    """A model plus its engine.

    Args:
        model: a checkpoint directory (``config.json`` + safetensors) of a ``deepseek_v32`` or
            ``glm_moe_dsa`` model, a Llama ``.gguf`` file, or ``"smollm2"`` (bundled).
        kv_placement: ``"hisparse"`` (host pool + GPU hot buffers) or ``"gpu"``.
        hisparse: HiSparse settings; ``top_k`` defaults to the model's ``index_topk``.
            ``host_pool_gib`` defaults to what ``max_num_seqs`` requests of ``max_model_len``
            tokens of this model need, capped at half the host memory available.
        max_num_seqs: most requests running at once (1 to 4096; default
            `hisparse.defaults.DEFAULT_MAX_NUM_SEQS`, as ``hisparse serve`` and ``generate``).
        max_model_len: most tokens of one request (prompt + output); default and most: the
            model's context limit.
        gpu_memory_gib: GPU (or, on a CPU run, device) memory for the KV cache; default
            85% of the GPU memory free once the weights are loaded (1 GiB on the CPU).
        gpu_memory_utilization: instead of ``gpu_memory_gib``, vLLM's way: the fraction of
            the GPU's whole memory this engine may take; the KV cache gets what is left of it
            after what is in use (the weights, other processes). On a CPU run: that
            fraction of the host memory available.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on the CPU), ``"float32"``, ``"bfloat16"``,
            ``"float16"`` (or ``fp32``, ``bf16``, ``fp16``, ``half``, ``float``), or a
            ``torch.dtype`` of those.
        device: ``"cuda"``/``"cpu"`` (or a ``torch.device``); default CUDA when available.
        kv_format: KV row format. DSA: ``"fp8_ds_mla"``, ``"bf16"``, ``"fp32"``; ``"auto"``
            picks fp8_ds_mla where its row is 16-byte aligned (``kv_lora_rank`` a multiple
            of 128), else fp32 for an fp32 model on the CPU and bf16 otherwise. GQA:
            ``"bf16"``, ``"fp32"``; ``"auto"``: the model dtype. A format the checkpoint
            cannot store is refused here, naming one that works.
        indexer: ``"fp8"`` (DeepSeek's quantized scoring, 132 B keys) or ``"exact"``; GQA
            models also take ``"quest"`` and ``"lowrank"``.
        step_hooks: benchmark only: a `hisparse.engine.hooks.StepHooks` that changes steps
            in both placements alike (`hisparse.bench.hooks.BenchHooks`: top-k replay,
            synthetic prefill, swap-in timing). Every engine step's statistics go to
            ``step_stats`` (the last 10,000) and ``last_run_stats`` (every step of the
            latest `generate`).
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
        async_scheduling: on the fixed-shape decode path (CUDA graphs), a decode step
            leaves its tokens (and the logprobs asked for) on the device: the next decode of
            the same requests is scheduled and launched reading them there (its penalties and
            ``min_tokens`` counting them), and the host reads and processes the tokens while
            the GPU runs it (vLLM's async scheduling). The same tokens either
            way; a request that stops on a token computes one step more, which is dropped.
            Default on.
        tensor_parallel_size: ranks to shard the model over, one GPU each (on the CPU one
            process each, gloo); it must divide the attention heads (and KV heads) and the
            MLP widths. This object is rank 0; it spawns the others (a script needs the
            ``if __name__ == "__main__":`` guard), or under ``torchrun`` the other processes
            serve it. The node's ranks share one host pool. A rank that fails closes the
            engine with `hisparse.parallel.TensorParallelError` (docs/design.md §18).
        data_parallel_size, enable_expert_parallel: N ranks (processes as above) that each
            run attention, a scheduler and a host pool over their own requests (this object
            routes them); with expert parallelism each keeps ``1/N`` of every MoE layer's
            experts and the MoE runs over every rank's tokens (docs/design.md §21). Not
            combined with ``tensor_parallel_size`` yet.
        enable_prefix_caching: reuse cached pages of shared prefixes (vLLM's, default on; the
            same tokens; design §12.10). Off for V4, data parallelism, HiSparse under TP.
        speculative_config: a `SpeculativeConfig` or a dict of its fields (vLLM's shape): drafts
            verified in one decode step, the same tokens (design §12.11); one rank, sync steps.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        kv_placement: str = "hisparse",
        hisparse: HiSparseConfig | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        gpu_memory_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        kv_format: str = "auto",
        indexer: str = "fp8",
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        step_hooks: StepHooks | None = None,
        cuda_graphs: bool | None = None,
        schedule: str = "mixed",
        async_scheduling: bool = True,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_prefix_caching: bool = True,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
    ) -> None:
        # every rank builds the same engine from the same arguments
        llm_kwargs = dict(
            model=model, kv_placement=kv_placement, hisparse=hisparse,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype, device=device, kv_format=kv_format,
            indexer=indexer, max_num_batched_tokens=max_num_batched_tokens,
            step_hooks=step_hooks, cuda_graphs=cuda_graphs, schedule=schedule,
            async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel,
            enable_prefix_caching=enable_prefix_caching, speculative_config=speculative_config,
        )  # fmt: skip
        self._closed = False
        self._core: EngineCore | None = None
        self.kv: KVCacheManager | None = None
        self.runner: ModelRunner | None = None
        self.model: Any = None
        self._tp: TPGroup | None = None
        f = "LLM."
        # Every argument's type and range first: nothing is loaded for a bad one.
        model_dtype = check_llm_args(llm_kwargs)
        # (a speculative step's next drafts need its tokens read first: design §12.11)
        self.async_scheduling = bool(async_scheduling) and speculative_config is None
        dp = data_parallel_size > 1
        self.speculative = spec = SpeculativeConfig.for_engine(llm_kwargs)
        self.device = checked_device(device)
        torch_dtype = model_dtype or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        path = resolve_model(model)
        gguf = is_gguf(path)
        v4 = is_v4(path) and check_v4_arguments(llm_kwargs)  # design §20
        if gguf:
            check_choice(f + "kv_format", kv_format, GQA_KV_FORMATS)
            if step_hooks is not None and step_hooks.synthetic_prefill:
                _fail(f + "step_hooks", step_hooks, "no synthetic prefill for a GQA model "
                      "(DSA models only)")  # fmt: skip
        else:
            check_choice(f + "indexer", indexer, DSA_INDEXERS)
        dp_core.check_parallel_args(path, tensor_parallel_size, data_parallel_size,
                                    enable_expert_parallel, gguf, cuda_graphs)  # fmt: skip
        if tensor_parallel_size > 1:
            check_tensor_parallel_size(path, gguf, tensor_parallel_size)
        hs = SpeculativeConfig.widen(spec, hisparse or HiSparseConfig())
        if max(tensor_parallel_size, data_parallel_size) > 1:  # a rank's checks, here first
            check_before_ranks(path, gguf, hs, indexer, max_model_len, (kv_placement, kv_format,
                torch_dtype, self.device, enable_prefix_caching and dp, spec))  # fmt: skip
        try:
            tp = None
            if max(tensor_parallel_size, data_parallel_size) > 1:
                self._tp = tp = TPGroup.start(
                    max(tensor_parallel_size, data_parallel_size), self.device, llm_kwargs,
                    worker_main=worker_main, serve_ranks=serve_torchrun_ranks,
                    kind="data-parallel" if dp else "tensor-parallel",
                )  # fmt: skip
                self.device = tp.device
            shards = None if dp else tp  # data-parallel ranks hold the whole model
            experts = dp_core.expert_share(path, tp) if enable_expert_parallel else None
            loaded = load_model(path, hs, torch_dtype, self.device, indexer, kv_format, shards,
                                experts)  # fmt: skip
            if enable_expert_parallel:  # each rank keeps its experts only
                dp_core.expert_parallel(loaded.model, tp)
            self.model, self.config = loaded.model, loaded.config
            self.tokenizer, self.chat_template = loaded.tokenizer, loaded.chat_template
            self.eos_token_ids, self.grammars = loaded.eos_token_ids, loaded.grammars
            row_format, model_max_len = loaded.row_format, loaded.max_len
            check_max_model_len(max_model_len, model_max_len)
            self.max_model_len = max_model_len or model_max_len
            if gpu_memory_gib is None:
                gpu_memory_gib = default_kv_gib(self.device, gpu_memory_utilization)
                if tp is not None:  # the same pools on every rank: what the tightest GPU gives
                    gpu_memory_gib = tp.agree_min(gpu_memory_gib)
            check_device_memory(self.device, gpu_memory_gib)
            specs = engine_specs(self.model, row_format, self.config.block_size, kv_placement, spec)
            # GQA rows are sharded by KV head: a host row holds every local rank's slice
            host = host_sharing(shards, gguf)  # data parallelism: a pool per rank
            # V4 carries state outside its pages; ranks would share the host's indexer copies
            prefix = enable_prefix_caching and not (v4 or (shards and kv_placement != "gpu"))
            if kv_placement == "hisparse" and self.config.host_pool_bytes is None:
                size = default_host_pool_bytes(
                    specs,
                    self.config,
                    self.max_model_len,
                    max_num_seqs,
                    host_shards=host["host_shards"],
                    indexer_copy=prefix,
                )
                if tp is not None:
                    size = tp.from_driver(size)  # sized from the driver's view of free memory
                self.config = dataclasses.replace(self.config, host_pool_bytes=size)
            self.kv = KVCacheManager(
                specs,
                self.config,
                placement=kv_placement,
                gpu_budget_bytes=int(gpu_memory_gib * 2**30),
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
                device=self.device,
                max_num_batched_tokens=max_num_batched_tokens,
                prefix_caching=prefix,
                cache_key=f"{path}|{row_format}|{indexer}|{torch_dtype}".encode(),
                **host,
            )
            self.runner = ModelRunner(
                self.model,
                self.config,
                self.kv,
                specs,
                row_format=row_format,
                max_num_seqs=max_num_seqs,
                device=self.device,
                hooks=step_hooks,
                decode_path="eager"
                if dp or getattr(spec, "method", None) == "mtp"  # (k + 1)-row steps: eager
                else decode_path(cuda_graphs, self.device, indexer, tensor_parallel_size, not v4),
                host_fence=shards.fence if shards is not None and not gguf else None,
                eos_token_ids=self.eos_token_ids,
                share_tokens=shards.share_tokens if shards is not None else None,
                samples=shards is None or shards.is_driver,
            )
        except BaseException as err:
            self._release(failed=True)  # the host pool, the device pools, the model
            tp = self._tp
            if tp is not None and tp.is_driver and not tp.closed:
                raise tp.fail(err) from err  # ends the other ranks, names the one that failed
            raise  # a worker's error goes to its driver (`worker_main`)
        scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=schedule,
            stops=OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len),
            speculative=spec,
        )
        # async scheduling chains fixed-shape decodes on one rank (docs/design.md §12.5.1)
        chained = self.async_scheduling and tp is None and self.runner.graphs is not None
        core = dp_core.DataParallelCore if dp else AsyncEngineCore if chained else EngineCore
        self._core = core(scheduler, self.runner, tp=tp, on_fatal=self._fatal)
        self._ids = itertools.count()

    # --- the engine core's state, as the API shows it ---------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        assert self._core is not None, "this LLM was closed"
        return self._core.scheduler

    def engine_gauges(self) -> Any:
        """Requests, pool blocks and cache counters (`EngineGauges`; every rank's summed)."""
        return self._core.gauges()  # type: ignore[union-attr]

    @property
    def step_stats(self) -> Any:
        """The last `STEP_STATS_KEPT` engine steps' statistics rows (all calls)."""
        return self._core.step_stats if self._core is not None else []

    @property
    def last_run_stats(self) -> list[dict[str, float]]:
        """Every engine step's statistics row of the latest `generate`."""
        return self._core.last_run_stats if self._core is not None else []

    @property
    def _inflight(self) -> Any:
        """The decode step in flight (async scheduling), or None."""
        return getattr(self._core, "inflight", None)

    def _fatal(self) -> None:
        """A rank failed inside a tensor-parallel step: this engine is closed."""
        self._closed = True
        self._release(failed=True)

    # ------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Any = None,
        use_tqdm: bool = False,
        progress: bool = False,
        on_finish: Callable[[int, int], None] | None = None,
        on_step: Callable[[list[Request]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one `RequestOutput` per prompt, in input order.

        ``prompts``: a string, a list of strings, or vLLM-style dicts ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``; or ``prompt_token_ids``: a list of token ids (one
        prompt) or a list of such lists. ``sampling_params``: one for all prompts or one per
        prompt; with ``n > 1`` each completion is its own request (the prompt is computed
        ``n`` times, less what the prefix cache holds).

        A prompt the engine can never run (not text or integer ids, empty, ids outside the
        vocabulary, no room for output under ``max_model_len``) raises `ValueError` (or
        `TypeError`) naming it before anything runs, as vLLM does; a request that fails at run
        time fails its own output (``finish_reason == "error"``) while the others run on.
        Ctrl-C raises `GenerationInterrupted` with what was generated so far. ``use_tqdm``
        (or ``progress``): a progress bar of finished requests; ``on_finish(done, total)``
        whenever completions finish and ``on_step(requests)`` after every engine step
        (progress displays: a request's ``num_computed`` counts its prefilled tokens)."""
        self._check_open("generate")
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        items = text_inputs(prompts) if prompts is not None else token_inputs(prompt_token_ids)
        check_bool("LLM.generate.use_tqdm", use_tqdm)
        return self._generate(items, sampling_params, progress or use_tqdm, on_finish, on_step)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        progress: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a
        list of them, through the model's chat template (a GGUF file's
        ``tokenizer.chat_template``; a checkpoint folder's ``chat_template.jinja`` or
        ``tokenizer_config.json``). One `RequestOutput` per conversation, its ``prompt`` the
        rendered text; ``tools`` and ``chat_template_kwargs`` (vLLM's) go to the template. A
        malformed message, or one the template refuses, is a `ValueError` naming it."""
        self._check_open("chat")
        convs, _ = check_conversations(messages)
        check_bool("LLM.chat.add_generation_prompt", add_generation_prompt)
        kw = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        items = []
        for i, conv in enumerate(convs):
            where = "messages" if len(convs) == 1 else f"messages[{i}]"
            text, ids = self._render_chat(conv, add_generation_prompt, where, **kw)
            items.append((text, ids, None))
        check_bool("LLM.chat.use_tqdm", use_tqdm)
        return self._generate(items, sampling_params, progress or use_tqdm, None)

    def _render_chat(
        self, conv: list[dict[str, Any]], add_gen: bool, where: str, **kw: Any
    ) -> tuple[str, list[int]]:
        """One checked conversation through the chat template: (text, token ids)."""
        return render_chat(self.chat_template, self.tokenizer, conv, add_gen, where, **kw)

    # --- online use: requests added at any time, one step at a time (the server) ---------
    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's ``get_tokenizer``): ``encode(text)`` -> ids,
        ``decode(ids)``, ``apply_chat_template(messages)`` -> text."""
        from hisparse.models.tokenizer import api_tokenizer

        return api_tokenizer(self.tokenizer, self.chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (no chat template)."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; send token ids instead")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(getattr(ids, "ids", ids))

    def chat_token_ids(self, messages: Any, **template_kwargs: Any) -> list[int]:
        """One conversation's prompt through the chat template (kwargs: tools, switches)."""
        (conv,), _ = check_conversations([messages])
        return self._render_chat(conv, True, "messages", **template_kwargs)[1]

    def add_request(
        self,
        prompt_token_ids: Any,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> list[Request]:
        """Queue one prompt's ``params.n`` completions for `step` to run. Bad input raises
        (`ValueError` / `TypeError` naming it) and queues nothing."""
        self._check_open("add_request")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params={params!r} must be a SamplingParams")
        ids = prompt_ids(self, prompt if prompt_token_ids is None else None, prompt_token_ids)
        if isinstance(ids, str):
            raise ValueError(ids)
        rid = request_id if request_id is not None else str(next(self._ids))
        reqs = completions(rid, ids, params, prompt, self.grammars)
        self._core.add(reqs)
        return reqs

    def step(self) -> list[Request]:
        """Run one engine step (its decode and prefill parts); the requests it changed: new
        tokens, finished, or failed (a prompt the GPU pool can never hold)."""
        self._check_open("step")
        core = self._core
        assert core is not None
        sched = core.scheduler
        changed: dict[int, Request] = {}
        with core.tp_section():
            for reqs, row in core.step():
                core.step_stats.append(row)
                changed.update((id(r), r) for r in reqs)
        changed.update((id(r), r) for r in sched.failed)
        sched.failed.clear()
        return list(changed.values())

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request and free its blocks; False if it is not here."""
        for req in self._core.unfinished():
            if req.req_id == request_id:
                self._core.abort([req])
                self._core.settle()
                return True
        return False

    def set_max_num_seqs(self, n: int) -> None:
        """Run at most ``n`` requests at once from now on (1 to the ``max_num_seqs`` the
        engine was built with; the pools stay as they are)."""
        self._check_open("set_max_num_seqs")
        check_int("LLM.set_max_num_seqs.n", n, minimum=1, maximum=self.kv.max_num_seqs)
        with self._core.tp_section():
            self.scheduler.max_num_seqs = n
            if self._tp is not None:
                self._tp.send(("max_num_seqs", n))

    def _tensor_parallel_state(self) -> list[dict[str, Any]]:
        """Every rank's `rank_state`, in rank order (tests)."""
        self._check_open("_tensor_parallel_state")
        return tensor_parallel_state(self)

    def has_unfinished_requests(self) -> bool:
        return self._core is not None and self._core.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Evict every cached page no request holds (docs/design.md §12.10); how many."""
        return self.kv.prefix_cache.clear() if self.kv and self.kv.prefix_cache else 0

    def _generate(
        self,
        items: list[tuple[str | None, Any, str | None]],
        sampling_params: Any,
        progress: bool,
        on_finish: Callable[[int, int], None] | None,
        on_step: Callable[[list[Request]], None] | None = None,
    ) -> list[RequestOutput]:
        """``items``: per prompt (text, token ids, error); text without ids is tokenized.
        Every prompt is read and checked before any is queued: one that can never run
        raises, naming it (`never_runs`)."""
        params = params_per_prompt(sampling_params, len(items))
        check_bool("progress", progress)
        groups: list[tuple[str, str | None, list[Request]]] = []
        for i, ((text, ids, error), p) in enumerate(zip(items, params, strict=True)):
            ids = prompt_ids(self, text, ids) if error is None else error
            if isinstance(ids, str):
                raise never_runs(ids, i, len(items))
            rid = str(next(self._ids))
            groups.append((rid, text, completions(rid, ids, p, text, self.grammars)))
        requests = [r for _, _, reqs in groups for r in reqs]
        # Queued only once every prompt was read: nothing of this call is left behind if
        # reading one fails.
        self._core.add([req for req in requests if not req.finished])
        try:
            with young_objects_only(self.device):
                run_with_progress(self._core, requests, progress, on_finish, on_step)
        except BaseException as err:
            # Whatever stopped the run (an error, Ctrl-C), the engine stays usable: this
            # call's unfinished requests leave the scheduler and give their blocks back.
            # (A failed tensor-parallel engine is closed: nothing is left to abort.)
            if not self._closed:
                self._core.abort([req for req in requests if not req.finished])
                self._core.settle()
            if isinstance(err, KeyboardInterrupt) and not isinstance(err, GenerationInterrupted):
                raise GenerationInterrupted(outputs_of(groups, self.tokenizer)) from err
            raise
        return outputs_of(groups, self.tokenizer)

    # --- resources -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the host pool, the device KV pools, the runner's state and the model now;
        later calls of `generate` / `chat` raise `RuntimeError` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self, failed: bool = False) -> None:
        """Drop everything; ``failed``: a tensor-parallel failure, whose caller ends the
        ranks (`TPGroup.fail`)."""
        core = getattr(self, "_core", None)
        if core is not None:
            core.drain()  # a step in flight reads and writes the pools released below
            core.runner = None
        if self.kv is not None:
            self.kv.close()
        self.runner = None
        self.model = None
        if self._tp is not None and not failed:
            self._tp.shutdown()  # the driver closes its ranks; a worker drops its groups
        # The runner's layer objects refer to each other: without a collection now, the device
        # pool and the host backing they view would live on until the collector ran.
        gc.collect()
        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"this LLM was closed: {what}() needs a new LLM(...) (close() released its "
                "host pool, KV cache and model)"
            )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
