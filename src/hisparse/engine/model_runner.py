"""Runs one engine step of a DSA model over the HiSparse runtime (or all-GPU placement).

The runner builds the step's metadata once (token positions, block tables, write slots), binds
it to every index group's leader, and hands the model a `DsaKVCache` whose per-layer caches are
the runtime's `CacheHandle`s. A HiSparse prefill step reads its requests' contexts through the
prefill staging area (`hisparse.runtime.staging.PrefillStaging`: each layer gathers its earlier
rows from the host, writes the chunk's rows there, mirrors them to the host and copies the
tail pages' rows into the pool), so a prefilling request holds only its tail pages resident;
an all-GPU prefill maps its top-k through the resident table. A decode step resolves against
the hot buffers and swaps misses in. After a request's last prefill chunk its hot buffers are
warmed from the host with the prefill's last-token selection.

Decode steps take one of two paths: the plain eager step (any batch, the CPU default), or the
fixed-shape step of `hisparse.engine.cuda_graphs` (batch padded to a captured size, no host
read from the inputs' copy to the logits), captured as CUDA graphs on CUDA. Both placements
take the same path.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Set
from dataclasses import dataclass

import torch

from hisparse.config import ResolvedHiSparseConfig
from hisparse.engine.cuda_graphs import DecodeGraphs
from hisparse.engine.decode_inputs import decode_inputs, step_counts
from hisparse.engine.hooks import StepHooks, StepRequests
from hisparse.engine.host_copy import tensor_to_device
from hisparse.engine.kv_manager import KVCacheManager
from hisparse.engine.mtp_drafts import MtpDrafter
from hisparse.engine.request import Request
from hisparse.engine.sampling import sample_rows
from hisparse.engine.spec_verify import verify
from hisparse.engine.static_verify import run_static_verify, static_verify_takes
from hisparse.engine.step_cache import PrefillLayerCache, StepCache
from hisparse.engine.step_data import ModelOutput, ScheduledStep, SchedulerOutput, WriteBack
from hisparse.engine.v4_step_cache import V4StepCache
from hisparse.engine.warm_start import WarmStart
from hisparse.kv.specs import CacheKind, LayerCacheSpec
from hisparse.models.kv_access import ForwardStep
from hisparse.models.llama_cpu_rows import verify_logits_cpu
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.ops import cpu_backend
from hisparse.runtime.sparse_layer import SparseLayerRuntime
from hisparse.runtime.staging import PrefillStaging
from hisparse.runtime.streams import CopyStream


@dataclass
class StepResult:
    """Logits of the rows that sample (one per request whose step ends at a new token);
    a synthetic prefill has no logits and gives its tokens directly. On the CUDA-graph path
    the logits are the graph's output buffer: valid until the next step runs."""

    logits: torch.Tensor | None
    sample_reqs: list[Request]
    token_ids: list[int] | None = None


#: decode paths: plain eager; fixed-shape padded step run eagerly; the same step in CUDA graphs
DECODE_PATHS = ("eager", "padded", "graphs")


class ModelRunner:
    """Runs engine steps. ``decode_path`` picks the decode step (`DECODE_PATHS`);
    ``hooks`` (`hisparse.engine.hooks.StepHooks`) let a benchmark change a step; hooks that
    are not ``capturable`` make ``graphs`` run the same fixed-shape step without capture."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ResolvedHiSparseConfig,
        kv: KVCacheManager,
        specs: list[LayerCacheSpec],
        *,
        row_format: object,
        max_num_seqs: int,
        device: torch.device,
        hooks: StepHooks | None = None,
        decode_path: str = "eager",
        host_fence: Callable[[], None] | None = None,
        eos_token_ids: Set[int] = frozenset(),
        share_tokens: Callable[[list[int | None], int], list[int | None]] | None = None,
        samples: bool = True,
    ) -> None:
        """``host_fence``: tensor parallelism with one host writer per node (docs/design.md
        §18): called at the start of the step after one whose pages were written back to the
        host outside the forward (the lazy mirror), so no rank reads those rows before the
        writer's copies are done. ``samples``: this rank samples (rank 0 under tensor
        parallelism: its generators, its penalties); ``share_tokens(tokens, n)`` hands its
        tokens to every rank. Where ``specs`` hold the model's MTP layer, it drafts
        (`mtp_drafts.MtpDrafter`; the eager decode path)."""
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path={decode_path!r}: use one of {DECODE_PATHS}")
        if decode_path == "graphs" and device.type != "cuda":
            raise ValueError("decode_path='graphs' needs a CUDA device: pass cuda_graphs=False")
        self.model, self.config, self.kv = model, config, kv
        self.eos_token_ids = eos_token_ids
        self.share_tokens, self.samples = share_tokens, samples
        self.row_format = row_format
        self.device = device
        self.max_num_seqs = max_num_seqs
        copy = CopyStream(device)
        self.runtimes: list[SparseLayerRuntime] = []
        self.handles: list[CacheHandle] = []
        self.leaders: list[CacheHandle] = []
        group_handles: list[list[CacheHandle]] = []
        for spec in (s for s in specs if s.kind is CacheKind.SPARSE):
            lead = spec.is_index_group_leader
            rt = SparseLayerRuntime(
                spec.name,
                config,
                row_bytes=spec.row_bytes,
                max_num_reqs=max_num_seqs,
                device=device,
                index_group=None if lead else self.runtimes[-1].group,
                copy_stream=copy,
                hisparse=kv.hisparse,
            )
            rt.bind_device(kv.gpu_view(spec.name))
            if kv.hisparse:
                rt.bind_host(kv.host_view(spec.name))
                rt.writes_host = kv.host_writer
            handle = CacheHandle(rt)
            self.runtimes.append(rt)
            self.handles.append(handle)
            if lead:
                self.leaders.append(handle)
                group_handles.append([handle])
                if kv.hisparse:
                    rt.group.bind_hot_block_table(kv.hot_block_tables[kv.group_of_layer[spec.name]])
            else:
                group_handles[-1].append(handle)
        for hs in group_handles:
            CacheHandle.link_index_group(hs)
        #: layer index -> that layer's indexer pages ``[blocks, block_size * row_bytes]``
        self.indexer_pages = {
            int(s.name.split(".")[1]): kv.gpu_pages(s.name)
            for s in specs
            if s.kind is CacheKind.INDEXER
        }
        #: the warm start of the prefill step running (`hisparse.engine.warm_start`)
        self.warm: WarmStart | None = None
        self.leader_index = {h.runtime.name: i for i, h in enumerate(self.leaders)}
        #: KV bytes one miss of each leader's group moves (row bytes of all its layers)
        self.group_row_bytes = torch.tensor(
            [sum(ly.row_bytes for ly in h.runtime.group.layers) for h in self.leaders],
            dtype=torch.int64,
            device=device,
        )
        #: every leader's per-request hits and misses as views of one ``[G, S, 2]`` tensor
        #: (the resolves write them), so a step's counts read them with no stack
        groups = [h.runtime.group for h in self.leaders]
        shapes = {tuple(g.hit_miss.shape) for g in groups}
        self.hit_miss_all: torch.Tensor | None = None
        if len(shapes) == 1:
            shape = (len(groups), *shapes.pop())
            self.hit_miss_all = torch.zeros(shape, dtype=torch.int32, device=device)
            for g, view in zip(groups, self.hit_miss_all, strict=True):
                g.share_hit_miss(view)
        self.hooks = hooks
        self._zero_table = torch.zeros(
            (max_num_seqs, kv.max_blocks), dtype=torch.int32, device=device
        )
        #: the counters of a step that resolves nothing (all-GPU, or every page resident):
        #: read only, so a step returns a slice of it instead of filling a new tensor
        self._zero_counts = torch.zeros((max_num_seqs, 3), dtype=torch.int64, device=device)
        # this step's per-request device tensors (set by `run`)
        self._slots = self._lens = self._keys = torch.zeros(0, dtype=torch.int64)
        self._max_len = 0
        self._prefill_cache: StepCache | None = None
        #: per decode step: (requests, device int64 [R, 3] hits / misses / bytes)
        self._pending: list[tuple[list[Request], torch.Tensor]] = []
        self.decode_path = decode_path
        self.graphs: DecodeGraphs | None = None
        #: the fixed-shape verify steps' graphs (`engine.static_verify`; made on first use)
        self.verify_graphs: DecodeGraphs | None = None
        if decode_path != "eager":
            # hooks that cannot live in a graph (timing events) run the fixed-shape step
            # eagerly in both placements, so their times stay comparable
            capture = decode_path == "graphs" and (hooks is None or hooks.capturable)
            self.graphs = DecodeGraphs(max_num_seqs, device, capture=capture)
        if hooks is not None:
            hooks.bind(self)
        self.host_fence = host_fence
        self._fence_pending = False
        #: pages the lazy mirror copied to the host (`write_back`), counted per resident group
        self.pages_written_back = 0
        #: DeepSeek-V4: its compressors' state per request slot (`engine.v4_step_cache`)
        new_state = getattr(model, "new_slot_state", None)
        self.v4_state = (
            new_state(max_num_seqs + 1, device, window_ring=kv.hisparse)
            if new_state is not None
            else None
        )
        self.mtp = MtpDrafter.of(self, specs)

    def reset_slot(self, slot: int) -> None:
        for leader in self.leaders:
            leader.runtime.group.reset_slot(slot)
        if self.hooks is not None:
            self.hooks.reset_slot(slot)

    @staticmethod
    def request_key(req: Request) -> int:
        """Stable key of a request for replay and synthetic data (same in both placements)."""
        return zlib.crc32(req.req_id.encode()) & 0x7FFFFFFF

    # --- step hooks (called by the step caches) ------------------------------------------
    def step_requests(self) -> StepRequests:
        return StepRequests(self._slots, self._lens, self._keys, self._max_len)

    def hooked_decode_topk(self, leader_name: str, logical_topk: torch.Tensor) -> torch.Tensor:
        assert self.hooks is not None
        leader = self.leader_index[leader_name]
        return self.hooks.decode_topk(leader, logical_topk, self.step_requests())

    # ------------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> list[ModelOutput]:
        """Run a scheduled step: what comes before its forwards (`prepare`), then each
        forward and its sampling, in order; one `ModelOutput` per forward."""
        self.prepare(out)
        return [self.execute_part(part) for part in out.parts]

    def prepare(self, out: SchedulerOutput) -> None:
        """Before a step's forwards, in the order they were made: the block-table changes,
        the hot state of newly leased slots reset, the lazy mirror's write-backs, the prefix
        cache's indexer key copies (`KVCacheManager.copy_indexer_pages`)."""
        self.kv.apply_table_updates(out.table_updates)
        for slot in out.slot_resets:
            self.reset_slot(slot)
        self.write_back(out.write_backs)
        self.kv.copy_indexer_pages(out.indexer_copies)

    def execute_part(self, step: ScheduledStep) -> ModelOutput:
        """One forward and its sampled tokens (a synthetic prefill gives them directly); a
        speculative step's drafts verified row by row (`spec_verify.verify`)."""
        result = self.run(
            step.batch, decode=step.decode, finishing=step.finishing, drafts=step.drafts
        )
        reqs = result.sample_reqs
        if step.drafts is not None:
            if self.share_tokens is not None:
                raise NotImplementedError("speculative decoding under tensor parallelism")
            assert result.logits is not None
            v = verify(result.logits, reqs, step.drafts, self.eos_token_ids)
            if self.mtp is not None:
                self.mtp.keep(v.accepted)
            now = time.perf_counter()
            return ModelOutput(reqs, v.tokens, v.logprobs, now, v.accepted, v.accepted_logprobs)
        logprobs: list[dict[int, float] | None]
        if result.token_ids is not None:
            tokens: list[int | None] = list(result.token_ids)
            logprobs = [{} for _ in tokens]  # no logits: a synthetic prefill's first token
        elif reqs:
            if self.samples:
                assert result.logits is not None
                sampled = sample_rows(result.logits, reqs, self.eos_token_ids)
                tokens, logprobs = sampled.tokens, sampled.logprobs
            else:
                tokens, logprobs = [], [None] * len(reqs)
            if self.share_tokens is not None:
                tokens = self.share_tokens(tokens, len(reqs))
        else:
            tokens, logprobs = [], []
        if self.mtp is not None:
            self.mtp.keep(None)
        return ModelOutput(reqs, tokens, logprobs, time.perf_counter())

    @torch.no_grad()
    def run(
        self,
        batch: list[tuple[Request, int]],
        *,
        decode: bool,
        finishing: list[bool],
        device_ids: torch.Tensor | None = None,
        drafts: list[list[int]] | None = None,
    ) -> StepResult:
        """Forward ``batch`` (request, new tokens); logits for requests that sample now
        (a speculative decode, ``drafts`` given: every row's, the request's last token then
        its drafts).

        Per-step inputs travel in one host-to-device copy; block tables are gathered on the
        device from the KV manager's persistent tables. ``device_ids``: a fixed-shape decode's
        input tokens, one per request in batch order, still on the device (the previous
        decode's sampled tokens, async scheduling) instead of the requests' last tokens."""
        kv, bs, dev = self.kv, self.config.block_size, self.device
        if self._fence_pending:
            self._fence_pending = False
            assert self.host_fence is not None
            self.host_fence()
        if decode and self.graphs is not None and all(n == 1 for _, n in batch):
            # the fixed-shape step holds one row per request (no speculative rows)
            return self._run_static_decode([req for req, _ in batch], device_ids)
        if drafts is not None and device_ids is None and static_verify_takes(self, drafts):
            return run_static_verify(self, [req for req, _ in batch], drafts)
        if device_ids is not None:
            raise ValueError("device_ids: only a fixed-shape (CUDA-graph path) decode takes them")
        R = len(batch)
        if self.mtp is not None and decode:
            self.mtp.draft(batch, drafts)  # fills the scheduler's placeholders
        starts = [req.num_computed for req, _ in batch]
        counts = [n for _, n in batch]
        slots_l = [kv.requests[req.req_id].slot for req, _ in batch]
        keys_l = [self.request_key(req) for req, _ in batch]
        hooks = self.hooks
        synthetic = hooks is not None and hooks.synthetic_prefill and not decode
        ids: list[int] = []
        if drafts is not None:
            for (req, _), d in zip(batch, drafts, strict=True):
                ids.extend(req.token_slice(req.num_computed, 1) + d)
        elif not synthetic:
            for req, n in batch:
                ids.extend(req.token_slice(req.num_computed, n))
        T = sum(counts)
        if self.mtp is not None:  # the MTP layer's rows: each with the token after it
            ids.extend(self.mtp.next_tokens(batch, decode, drafts))
        packed = torch.tensor(starts + counts + slots_l + keys_l + ids, dtype=torch.int64)
        packed = packed.to(dev)
        start_d, count_d, slot_d, key_d = packed[: 4 * R].view(4, R)
        seq_lens = start_d + count_d
        if decode and T == R:
            rix = torch.arange(R, device=dev)
            pos = start_d
        else:
            rix = torch.repeat_interleave(torch.arange(R, device=dev), count_d, output_size=T)
            first = torch.cumsum(count_d, 0) - count_d
            pos = start_d[rix] + torch.arange(T, device=dev) - first[rix]
        self._slots, self._lens, self._keys = slot_d, seq_lens, key_d
        self._max_len = max(s + n for s, n in zip(starts, counts, strict=True))
        step = ForwardStep(positions=pos, req_index=rix, seq_lens=seq_lens,
                           max_len=self._max_len, verify=drafts is not None)  # fmt: skip

        one_cpu = decode and T == 1 and dev.type == "cpu"

        def rows_of(table: torch.Tensor) -> torch.Tensor:
            if one_cpu and table.is_cpu:
                return cpu_backend().token_row(table, starts[0], bs)
            blk = table.long()[rix, pos // bs]
            return torch.where(blk > 0, blk * bs + pos % bs, -1).to(torch.int32)

        host_t, idx_table, res_tables = kv.step_tables(slot_d)
        host_bt = host_t if host_t is not None else self._zero_table[:R]
        state = slot_d.to(torch.int32) if decode else torch.full_like(slot_d, -1, dtype=torch.int32)
        resident = decode and self._all_resident([req.req_id for req, _ in batch])
        meta = StepMetadata(
            num_tokens=T,
            is_decode=decode,
            req_per_token=rix.to(torch.int32),
            request_state_indices=state,
            source_block_table=host_bt,
            host_slot_mapping=rows_of(host_bt) if kv.hisparse else None,
            all_resident=resident,
        )
        tables = [GroupTables(resident_block_table=t, slot_mapping=rows_of(t)) for t in res_tables]
        for leader in self.leaders:
            leader.prepare_group_for_batch(meta, tables[kv.group_of_layer[leader.runtime.name]])

        last_rows = list(itertools.accumulate(counts))
        self.warm = None if decode else WarmStart.for_step(self, finishing, last_rows)
        sample_reqs = [req for (req, _), f in zip(batch, finishing, strict=True) if f or decode]
        staging = None
        if not decode and kv.hisparse:
            # every context page of the step's requests, one layer at a time (§6.6); a
            # synthetic prefill only writes, so it gathers nothing
            assert kv.staging_raw is not None
            staging = PrefillStaging(
                kv.staging_raw, host_bt, starts, counts, rix, pos, bs, gather_earlier=not synthetic
            )
        cache = StepCache(self, decode, rows_of(idx_table), idx_table, staging)
        model_cache = (
            cache if self.v4_state is None else V4StepCache(self, self.v4_state, cache, step)
        )
        if synthetic:
            assert hooks is not None
            self._prefill_cache = cache
            hooks.write_prefill(self, rows_of(idx_table), key_d[rix], pos)
            self._prefill_cache = None
            if self.warm is not None:
                self.warm.record_hooked()
            vocab = self.model.config.vocab_size  # type: ignore[union-attr]
            tokens = hooks.first_tokens([self.request_key(r) for r in sample_reqs], vocab)
            logits = None
        else:
            if hooks is not None:
                hooks.begin_step(decode)
            hidden = self.model(packed[4 * R : 4 * R + T], step, model_cache)
            if self.mtp is not None:
                self.mtp.write_rows(hidden, packed[4 * R + T :], step, model_cache, batch)
            if hooks is not None:
                hooks.end_step(decode)
            if drafts is not None and R == 1 and dev.type == "cpu":
                logits = verify_logits_cpu(self.model, hidden)  # (row by row, or at once)
            elif decode:
                logits = self.model.logits(
                    hidden[torch.tensor(last_rows, device=dev) - 1]
                    if hidden.shape[0] != R and drafts is None
                    else hidden
                )
            else:
                sample_rows = [last_rows[r] - 1 for r, f in enumerate(finishing) if f]
                rows_t = torch.tensor(sample_rows, dtype=torch.long, device=dev)
                logits = self.model.logits(hidden[rows_t])
            tokens = None
        if self.warm is not None:
            ends = [s + n for s, n in zip(starts, counts, strict=True)]
            self.warm.seed([req.req_id for req, _ in batch], ends, self._slots, host_bt)
            self.warm = None
        if decode:
            self._record_hits([req for req, _ in batch], resolved=not resident)
        return StepResult(logits=logits, sample_reqs=sample_reqs, token_ids=tokens)

    # --- fixed-shape decode (padded batch; CUDA graphs) -----------------------------------
    def _run_static_decode(
        self, reqs: list[Request], device_ids: torch.Tensor | None = None
    ) -> StepResult:
        """A decode step through `DecodeGraphs`: one copy of the inputs (the token ids from
        ``device_ids`` where given), a replayed graph (or the same fixed-shape step run
        eagerly), logits of the real rows."""
        graphs = self.graphs
        assert graphs is not None
        kv = self.kv
        n = len(reqs)
        slots = [kv.requests[req.req_id].slot for req in reqs]
        keys = [self.request_key(req) for req in reqs]
        if device_ids is None:
            ids = [req.token_slice(req.num_computed, 1)[0] for req in reqs]
        elif device_ids.shape != (n,):
            raise ValueError(f"device_ids: {tuple(device_ids.shape)}, want one per request ({n})")
        else:
            ids = [0] * n  # replaced on the device below
        b = graphs.load(ids, [req.num_computed for req in reqs], slots, keys)
        resident = self._all_resident([req.req_id for req in reqs])
        if device_ids is not None:
            graphs.inputs[0, :n].copy_(device_ids)
        hooks = self.hooks
        # HiSparse with offload="under_pressure" runs both kinds of step (StepMetadata.all_resident)
        kind = dict(all_resident=resident, both_kinds=kv.policy.under_pressure,
                    keep_state=hooks.keep_step_state if hooks is not None else None)  # fmt: skip
        if hooks is None:
            logits, counts = graphs.run(b, self._static_step, **kind)
        else:
            hooks.before_padded_decode()
            try:
                hooks.begin_step(True)
                logits, counts = graphs.run(b, self._static_step, **kind)
                hooks.end_step(True)
            finally:
                lens = [req.num_computed + 1 for req in reqs]
                hooks.after_padded_decode(self, slots, keys, lens)
        self.warm = None
        self._pending.append((reqs, counts[:n].clone()))
        return StepResult(logits=logits[:n], sample_reqs=reqs)

    def _all_resident(self, req_ids: list[str]) -> bool:
        """`StepMetadata.all_resident` of a decode step over ``req_ids``: on CUDA, where the
        leader then looks rows up in the resident table; the CPU keeps its resolve (and so
        its real counters)."""
        return self.device.type == "cuda" and self.kv.all_resident(req_ids)

    def _static_step(
        self, b: int, all_resident: bool = False, rows: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode of the ``b`` requests in the graphs' inputs (padding: slot ``-1``), ``rows``
        rows each (a verify step: `engine.static_verify`), to logits ``[b · rows, vocab]``
        and hit / miss / byte counters ``[b, 3]``; ``all_resident``: the requests hold every
        page resident (`StepMetadata.all_resident`). Reads no device value on the host and
        allocates only per-step temporaries: CUDA-graph capturable."""
        graphs = self.graphs if rows == 1 else self.verify_graphs
        assert graphs is not None
        kv, bs = self.kv, self.config.block_size
        ids, pos, slot, key = graphs.inputs[:, : b * rows]
        # Every persistent table's rows of this batch and the new token's row in each (both
        # placements: HiSparse has a table per layer group); padded rows read and write the
        # spare slot max_num_seqs in the replay state. With several rows per request the
        # model sees each row as a one-row decode; the runtime sees each request's tables
        # (its first row's: a real request's first row is real) and slot once.
        d = decode_inputs(pos, slot, kv.table_stack, bs, self.max_num_seqs, rows)
        rix, seq_lens = d.req_index, d.seq_lens
        host_t, idx_table, res_tables = kv.split_stack(d.stack)
        host_rows, idx_rows, res_rows = kv.split_stack(d.rows)
        host_bt = host_t[::rows] if host_t is not None else self._zero_table[:b]
        self._slots = d.state_slots[::rows]
        self._lens = seq_lens if rows == 1 else seq_lens.view(b, rows).amax(1)
        self._keys = key[::rows]
        self._max_len = kv.max_blocks * bs
        meta = StepMetadata(
            num_tokens=b * rows,
            is_decode=True,
            req_per_token=d.request_of_row,
            request_state_indices=d.slot_i32[::rows].contiguous(),
            source_block_table=host_bt.contiguous(),
            host_slot_mapping=host_rows,
            all_resident=all_resident,
        )
        tables = [
            GroupTables(resident_block_table=t[::rows].contiguous(), slot_mapping=r)
            for t, r in zip(res_tables, res_rows, strict=True)
        ]
        for leader in self.leaders:
            leader.prepare_group_for_batch(meta, tables[kv.group_of_layer[leader.runtime.name]])
        step = ForwardStep(
            positions=pos, req_index=rix, seq_lens=seq_lens, max_len=self._max_len, static=True
        )
        cache = StepCache(self, True, idx_rows, idx_table)
        model_cache = (
            cache if self.v4_state is None else V4StepCache(self, self.v4_state, cache, step)
        )
        logits = self.model.logits(self.model(ids, step, model_cache))
        counts = self._step_counts(b) if kv.hisparse and not all_resident else self._zero_counts[:b]
        return logits, counts

    def prefill_layer_caches(self) -> list[PrefillLayerCache]:
        """The running prefill step's per-layer caches (for `StepHooks.write_prefill`: a
        synthetic prefill writes its rows through them, as the model's layers would)."""
        cache = self._prefill_cache
        if cache is None:
            raise RuntimeError("prefill_layer_caches: no prefill step is running")
        return [cache.attention(i) for i in range(len(self.handles))]  # type: ignore[misc]

    def _step_counts(self, n: int) -> torch.Tensor:
        """``[n, 3]`` int64 hits, misses and bytes moved of the step's first ``n`` requests,
        summed over the index groups (one launch on CUDA, `decode_inputs.step_counts`)."""
        hm = self.hit_miss_all
        if hm is None:  # groups of unequal buffers (not built by this runner): stack them
            hm = torch.stack([h.runtime.group.hit_miss for h in self.leaders])
        return step_counts(hm, n, self.group_row_bytes)

    def _record_hits(self, reqs: list[Request], *, resolved: bool = True) -> None:
        """Keep this step's per-request hits, misses and bytes swapped in on the device (read
        once, by `flush_metrics`): no host sync in the decode loop. ``resolved`` False: the
        step's rows were all resident (none counts)."""
        n = len(reqs)
        counts = self._step_counts(n) if self.kv.hisparse and resolved else self._zero_counts[:n]
        self._pending.append((reqs, counts))

    def flush_metrics(self) -> list[dict[str, float]]:
        """Add the recorded counters to each request's metrics; per decode step totals
        (hits, misses, bytes, and resolve / gather milliseconds when timing) in step order."""
        if not self._pending:
            return []
        all_counts = torch.cat([c for _, c in self._pending]).cpu().tolist()
        timings = self.hooks.step_timings() if self.hooks is not None else []
        steps: list[dict[str, float]] = []
        i = 0
        for k, (reqs, _) in enumerate(self._pending):
            tot = [0, 0, 0]
            for req in reqs:
                h, m, b = all_counts[i]
                i += 1
                req.metrics.hits += h
                req.metrics.misses += m
                req.metrics.bytes_swapped += b
                req.metrics.decode_steps += 1
                tot = [tot[0] + h, tot[1] + m, tot[2] + b]
            row: dict[str, float] = dict(hits=tot[0], misses=tot[1], bytes_swapped=tot[2])
            if k < len(timings):
                row.update(timings[k])
            steps.append(row)
        self._pending.clear()
        return steps

    def write_back(self, write_backs: list[WriteBack]) -> None:
        """The lazy mirror: copy resident pages' decode rows to their host blocks before the
        blocks are reused (`Scheduler._drop_resident` made the list); and a prefix-cache
        hit's shared pages from their host blocks into the resident blocks it was given
        (``to_gpu``)."""
        if not write_backs:
            return
        kv, bs = self.kv, self.config.block_size
        back = [wb for wb in write_backs if not wb.to_gpu]
        self.pages_written_back += sum(len(wb.blocks) for wb in back)
        # every rank holds the same pages, so every rank fences the next step alike
        self._fence_pending = self.host_fence is not None and bool(back)
        if not kv.host_writer:
            write_backs = [wb for wb in write_backs if wb.to_gpu]  # each rank fills its GPU
        offs = torch.arange(bs, dtype=torch.int64)
        for wb in write_backs:
            # every page's rows of this group in one copy per layer
            src = (torch.tensor(wb.blocks)[:, None] * bs + offs).flatten()
            dst = (torch.tensor(wb.host_blocks)[:, None] * bs + offs).flatten()
            src, dst = (tensor_to_device(t.to(torch.int32), self.device) for t in (src, dst))
            mask = torch.ones_like(src)
            by_name = {rt.name: rt for rt in self.runtimes}
            for name in kv.resident_groups[wb.group].layers:
                rt = by_name.get(name)  # the sparse layers' (not every layer is one: V4)
                if rt is None:
                    continue
                if wb.to_gpu:
                    rt.group.ops.gather_plan(rt.host_view, rt.device_view, dst, src, mask)
                else:
                    rt.group.ops.gather_plan(rt.device_view, rt.host_view, src, dst, mask)
