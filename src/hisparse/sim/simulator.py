"""The engine's scheduling and swap accounting, step by step, without a model or a GPU.

What is real here: the `Scheduler` (admission, chunked prefill, preemption), the
`KVBlockManager` (the block accounting alone, the plan's `KVLayout`), the
benchmarks' replayed top-k (`hisparse.bench.replay.replay_step`, same seed, same request keys,
so the selections are the bench's own) and the hot buffers' LRU (`hisparse.sim.hotbuf`,
checked against the reference resolve). What is modelled: the time of a step (a fixed cost,
a cost per decoding request, the PCIe time of its misses at measured rates, prefill tokens at a
set rate) and nothing of the model's numerics (every sampled token is 0; requests stop at
their output length).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hisparse.bench.replay import replay_step
from hisparse.config import HiSparseConfig, HiSparseConfigError
from hisparse.engine.device import default_host_pool_bytes
from hisparse.engine.kv_blocks import KVBlockManager
from hisparse.engine.model_runner import ModelRunner
from hisparse.engine.output_processor import OutputProcessor
from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.speculative import SpeculativeConfig
from hisparse.engine.step_data import ModelOutput, ScheduledStep
from hisparse.kv.cache_shapes import PRESETS, load_model_cache_shape
from hisparse.kv.specs import CacheKind, LayerCacheSpec
from hisparse.kv.v4_plan import v4_config_of
from hisparse.models.registry import dsa_row_format, engine_specs, resolve_model, v4_specs
from hisparse.models.v4_config import CSA
from hisparse.sim.hotbuf import HotBuffers
from hisparse.sim.pcie import RateTable
from hisparse.sim.trace import TraceRequest

#: Step-time defaults: a decode step's cost beside its gathers, a fixed part and a part per
#: decoding request (the gathers are added at the rate table's speed). They are the line
#: through the two all-GPU decode steps of `hisparse bench` at 128K in docs/benchmarks.md §1
#: (the 3 GiB cell's 7 requests and the equal-concurrency cell's 29; one H200, the v32 model's
#: 4 layers, the top-k replayed as here): an all-GPU step is a HiSparse step without a swap-in.
#: That section's `offload="always"` row at 29 requests is such a step plus every row's
#: swap-in. (The profile of §4, without the replay, measures shorter steps.)
DEFAULT_DECODE_MS = 1.82
DEFAULT_DECODE_MS_PER_REQUEST = 0.027
#: prefill tokens per second (synthetic prefill writes rows; a real prefill is slower: set it)
DEFAULT_PREFILL_TOK_S = 1.0e6


@dataclass
class SimSettings:
    """What `hisparse bench` / `LLM` would be given, plus the time model."""

    model: str
    gpu_memory_gib: float
    max_model_len: int
    max_num_seqs: int
    placement: str = "hisparse"
    max_num_batched_tokens: int = 16384
    block_size: int = 64
    top_k: int | None = None
    hot_buffer: int | None = None
    host_pool_gib: float | None = None
    kv_format: str = "auto"
    #: the device the engine would run on: its default dtype picks the row format
    target: str = "cuda"
    topk_overlap: float = 0.8
    seed: int = 0
    schedule: str = "mixed"
    #: `HiSparseConfig.offload` (the manager keeps or demotes resident pages, and resident
    #: entries touch no hot state, so the model follows without more); None: the default
    offload: str | None = None
    #: index-group leaders whose hot buffers are simulated (None: all); the others are
    #: counted as their average (every leader's replay follows the same model)
    sim_leaders: int | None = None
    #: fraction of requests whose selections and hot buffers are simulated; the others'
    #: misses are the sampled ones' running mean per decode step (1: every request, exact)
    sample_requests: float = 1.0
    #: request ids start here (`hisparse bench` numbers its warm-up requests first)
    id_offset: int = 0
    rates: RateTable = field(default_factory=lambda: RateTable.load(None))
    decode_ms: float = DEFAULT_DECODE_MS
    decode_ms_per_request: float = DEFAULT_DECODE_MS_PER_REQUEST
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S
    #: every prompt's first tokens are one document (questions over it, the turns of a
    #: conversation); 0: unrelated prompts
    shared_prefix: int = 0
    #: the engine's prefix cache (its default: on): a preempted request's recompute hits its
    #: own cached pages, and a shared document is prefilled once
    enable_prefix_caching: bool = True
    #: speculative decoding: drafts a decoding request brings to a step (0: none). The hot
    #: buffers are then those of ``max_query_len`` = k + 1 (the engine's), each verify step
    #: resolves all of a request's rows' selections against its one hot buffer and costs
    #: ``decode_ms_per_request`` per row; how many drafts are taken is drawn (``spec_acceptance``)
    num_speculative_tokens: int = 0
    #: the chance that a draft is taken given the ones before it were (drafts have no tokens
    #: here: the rate a task's proposer reaches, e.g. its ``acceptance_rate`` in a benchmark)
    spec_acceptance: float = 0.6


def engine_cache_specs(
    model: str, block_size: int, kv_format: str, target: str = "cuda", placement: str = "hisparse"
) -> tuple[list[LayerCacheSpec], int]:
    """The cache specs and top-k the engine would use: a checkpoint folder is built on the
    meta device and asked (`engine_specs`, the row format `LLM` picks for ``target``'s
    default dtype: bf16 on CUDA, fp32 on the CPU); a preset name is `hisparse plan`'s shape.
    DeepSeek-V4 (a `v4_plan` preset or a ``deepseek_v4`` checkpoint): its rows in that dtype
    (`registry.v4_specs`, which differ by ``placement``)."""
    v4 = v4_config_of(model)
    if v4 is not None:
        size = 2 if target == "cuda" else 4
        return v4_specs(v4, size, block_size, placement), v4.index_topk
    if model in PRESETS:
        fmt = "fp8_ds_mla" if kv_format == "auto" else kv_format
        shape = load_model_cache_shape(model, block_size=block_size, kv_format=fmt)
        return shape.specs, shape.index_topk
    from hisparse.models.deepseek_v32 import DsaConfig, DsaForCausalLM

    path = resolve_model(model)
    mcfg = DsaConfig.from_pretrained(path)
    with torch.device("meta"):
        net = DsaForCausalLM(mcfg, indexer_mode="fp8")
    dtype = torch.bfloat16 if target == "cuda" else torch.float32
    row_format = dsa_row_format(mcfg, kv_format, dtype, torch.device(target))
    return engine_specs(net, row_format, block_size), mcfg.index_topk


class Simulator:
    """One engine's worth of state; `run` plays a trace through it."""

    def __init__(self, s: SimSettings) -> None:
        if not 0.0 <= s.topk_overlap <= 1.0:
            raise HiSparseConfigError(f"top-k overlap {s.topk_overlap}: give a fraction in [0, 1]")
        self.s = s
        self.specs, index_topk = engine_cache_specs(
            s.model, s.block_size, s.kv_format, s.target, s.placement
        )
        v4 = v4_config_of(s.model)
        #: DeepSeek-V4: tokens per compressed sparse entry (the top-k picks entries; an entry
        #: is the row of its window's last token, design §20.2); None for DSA models
        self.rate = v4.compress_rates[CSA] if v4 is not None else None
        k = s.num_speculative_tokens
        if k < 0 or not 0.0 <= s.spec_acceptance <= 1.0:
            raise HiSparseConfigError(
                f"num_speculative_tokens={k}, spec_acceptance={s.spec_acceptance}: give k >= 0 "
                "(0: no speculation) and an acceptance in [0, 1], e.g. 4 and 0.6"
            )
        if k and self.rate is not None:
            raise HiSparseConfigError(
                "--num-speculative-tokens: the engine does not speculate with DeepSeek-V4; "
                "give 0 for this model"
            )
        config = HiSparseConfig(
            top_k=s.top_k,
            device_buffer_size=s.hot_buffer,
            host_pool_gib=s.host_pool_gib,
            block_size=s.block_size,
            offload=s.offload,
            max_query_len=k + 1,
        ).resolve(index_topk)
        caching = s.enable_prefix_caching and self.rate is None  # off for V4, as in `LLM`
        if s.placement == "hisparse" and config.host_pool_bytes is None:
            size = default_host_pool_bytes(
                self.specs, config, s.max_model_len, s.max_num_seqs, indexer_copy=caching
            )
            config = dataclasses.replace(config, host_pool_bytes=size)
        self.config = config
        self.kv = KVBlockManager(
            self.specs,
            config,
            placement=s.placement,
            gpu_budget_bytes=int(s.gpu_memory_gib * 2**30),
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            prefix_caching=caching,
        )
        self.sched = Scheduler(
            self.kv,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            policy=s.schedule,
            stops=OutputProcessor(None, set(), s.max_model_len),
            speculative=SpeculativeConfig(num_speculative_tokens=k) if k else None,
        )
        if k:
            self.sched.proposer = _Drafts()
        self._accept = np.random.default_rng(s.seed)
        sparse = [sp for sp in self.specs if sp.kind is CacheKind.SPARSE]
        leaders = [sp.name for sp in sparse if sp.index_leader == sp.name]
        #: resident group of each leader (its pages' residency decides what is wanted)
        self.leader_group = [self.kv.group_of_layer[name] for name in leaders]
        #: bytes of one token's rows of each index group (the span a miss reads)
        self.group_bytes = [
            sum(sp.row_bytes for sp in sparse if sp.index_leader == name) for name in leaders
        ]
        #: how many groups have each span (the leaders left out gather at their span)
        self._span_counts = Counter(self.group_bytes)
        n = len(leaders) if s.sim_leaders is None else max(1, min(s.sim_leaders, len(leaders)))
        self.leaders = sorted({round(x) for x in np.linspace(0, len(leaders) - 1, n)})
        #: each simulated leader stands for this many
        self.scale = len(leaders) / len(self.leaders)
        K, S = config.top_k, s.max_num_seqs
        self.keep = min(round(s.topk_overlap * K), K - 1)
        self.prev = torch.full((len(self.leaders), S, K), -1, dtype=torch.int32)
        self.hot = [HotBuffers(S, config.device_buffer_size, s.max_model_len) for _ in self.leaders]
        self._owner: dict[int, Any] = {}
        if not 0.0 < s.sample_requests <= 1.0:
            raise HiSparseConfigError(f"sample_requests={s.sample_requests}: give (0, 1]")
        #: sampled request-steps so far and their hits and misses (all simulated leaders)
        self._seen = [0, 0, 0]

    # --- one step ---------------------------------------------------------------------
    def _lease_resets(self) -> None:
        """A slot leased to a new admission starts cold (the runner's `reset_slot`)."""
        for rid, blocks in self.kv.requests.items():
            if blocks.slot >= 0 and self._owner.get(blocks.slot) is not blocks:
                self._owner[blocks.slot] = blocks
                self.prev[:, blocks.slot] = -1
                for hb in self.hot:
                    hb.reset(blocks.slot)
                self.admitted.setdefault(rid, self.clock)

    def _select(self, li: int, batch: list[Request], lens: list[int]) -> tuple[np.ndarray, Any]:
        """The replayed selection of each request (``lens``: its tokens with the new one) as
        rows; DeepSeek-V4 picks among the entries its windows closed, each the row of its
        window's last token."""
        slots = torch.tensor([self.kv.requests[r.req_id].slot for r in batch])
        keys = torch.tensor([ModelRunner.request_key(r) for r in batch], dtype=torch.int64)
        rate = self.rate
        count = [n // rate for n in lens] if rate else lens  # what the top-k picks among
        lens_t = torch.tensor([max(c, 1) for c in count], dtype=torch.int64)
        sel = replay_step(
            self.prev[li].index_select(0, slots),
            lens_t,
            keys,
            seed=self.s.seed,
            leader=self.leaders[li],
            keep=self.keep,
            max_len=int(lens_t.max()),
        )
        if rate:
            none = torch.tensor([c == 0 for c in count])[:, None]  # no window closed yet
            sel = sel.masked_fill(none, -1)
        self.prev[li].index_copy_(0, slots, sel)
        if rate:
            sel = torch.where(sel >= 0, sel * rate + rate - 1, -1)
        return slots.numpy(), sel.numpy().astype(np.int64)

    def _first_selection(self, n: int) -> int:
        """Rows a request of ``n`` tokens selects first (its warm start)."""
        return min(self.config.top_k, n // self.rate if self.rate else n)

    def _select_rows(
        self, li: int, reqs: list[Request], computed: list[int], rows: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """`_select` of a decode step whose request ``i`` brings ``rows[i]`` rows (its last
        token, then drafts): each row's replayed selection in turn (a row's follows the one
        before it, as a step's follows the last step's), a request's wanted rows their
        union, ``-1`` padded (what the runtime resolves against its one hot buffer)."""
        if max(rows) == 1:
            return self._select(li, reqs, [c + 1 for c in computed])
        per_row = []
        for j in range(max(rows)):
            which = [i for i, q in enumerate(rows) if q > j]
            part = [reqs[i] for i in which]
            _, sel = self._select(li, part, [computed[i] + 1 + j for i in which])
            per_row.append((which, sel))
        union: list[list[np.ndarray]] = [[] for _ in reqs]
        for which, sel in per_row:
            for at, i in enumerate(which):
                union[i].append(sel[at])
        wanted = [np.unique(np.concatenate(u)) for u in union]
        wanted = [w[w >= 0] for w in wanted]
        out = np.full((len(reqs), max(w.size for w in wanted)), -1, dtype=np.int64)
        for i, w in enumerate(wanted):
            out[i, : w.size] = w
        slots = np.array([self.kv.requests[r.req_id].slot for r in reqs])
        return slots, out

    def _resident_mask(self, reqs: list[Request], group: int, pages: int) -> np.ndarray:
        """``[B, pages]`` whether each page of each request is resident in resident group
        ``group`` (a lookup per selected entry, not a comparison with every resident page:
        a request may keep thousands, ``offload="under_pressure"``)."""
        out = np.zeros((len(reqs), pages), dtype=bool)
        for b, r in enumerate(reqs):
            res = np.fromiter(self.kv.requests[r.req_id].resident[group], dtype=np.int64)
            out[b, res[res < pages]] = True
        return out

    def _traffic(self, rows: list[float]) -> tuple[float, float]:
        """Bytes and PCIe seconds of the simulated leaders' gathers (``rows`` each, one span
        of its group per row); with leaders left out, every leader gathers their mean."""
        if len(rows) == len(self.group_bytes):
            pairs = list(zip(self.group_bytes, rows, strict=True))
            nbytes = float(sum(span * n for span, n in pairs))
            return nbytes, sum(self.s.rates.seconds(span, round(n)) for span, n in pairs)
        mean = sum(rows) / len(rows)
        nbytes = mean * sum(self.group_bytes)
        return nbytes, sum(
            count * self.s.rates.seconds(span, round(mean))
            for span, count in self._span_counts.items()
        )

    def _sampled(self, req: Request) -> bool:
        """Whether ``req``'s hot buffers are simulated (evenly spread over the trace)."""
        f, i = self.s.sample_requests, int(req.req_id) - self.s.id_offset
        return f >= 1.0 or int((i + 1) * f) > int(i * f)

    def _decode(self, step: ScheduledStep) -> dict[str, float]:
        every = [r for r, _ in step.batch]
        reqs = [r for r in every if self._sampled(r)]
        hits = misses = 0
        nbytes = pcie = 0.0
        per_leader: list[float] = []
        drafts = {id(r): len(d) for (r, _), d in zip(step.batch, step.drafts or [], strict=False)}
        if self.kv.hisparse and reqs:
            bs = self.config.block_size
            n = [r.num_computed for r in reqs]
            rows = [1 + drafts.get(id(r), 0) for r in reqs]
            masks: dict[int, np.ndarray] = {}  # per resident group: leaders may share one
            width = max(c + q - 1 for c, q in zip(n, rows, strict=True)) // bs + 1
            for li, leader in enumerate(self.leaders):
                slots, sel = self._select_rows(li, reqs, n, rows)
                # entries on resident pages (the manager's own: after `grow`) touch no hot state
                group = self.leader_group[leader]
                if group not in masks:
                    masks[group] = self._resident_mask(reqs, group, width)
                page = np.where(sel >= 0, sel // bs, 0)
                on_page = np.take_along_axis(masks[group], page, axis=1)
                wanted = np.where((sel >= 0) & ~on_page, sel, -1)
                h, m = self.hot[li].step(slots, wanted)
                hits += int(h.sum())
                misses += int(m.sum())
                per_leader.append(int(m.sum()))
            seen = self._seen
            seen[0] += len(reqs)
            seen[1] += hits
            seen[2] += misses
        rest = len(every) - len(reqs)
        if self.kv.hisparse and rest and self._seen[0]:
            # requests not sampled: the sampled ones' mean per request-step and leader
            n_sim, (k, h_sum, m_sum) = len(self.leaders), self._seen
            hits += rest * h_sum / k
            misses += rest * m_sum / k
            per_leader = per_leader or [0.0] * n_sim
            per_leader = [v + rest * m_sum / k / n_sim for v in per_leader]
        if per_leader:
            nbytes, pcie = self._traffic(per_leader)
        n_rows = len(every) + sum(drafts.values())
        secs = (self.s.decode_ms + self.s.decode_ms_per_request * n_rows) / 1e3 + pcie
        return dict(
            hits=hits * self.scale, misses=misses * self.scale, bytes=nbytes, pcie=pcie, secs=secs
        )

    def _prefill(self, step: ScheduledStep) -> dict[str, float]:
        """Prefill chunks; a finishing prompt warms its hot buffers with the replay's first
        selection (every selected row from the host, not counted as a miss), unless every
        page of it stayed resident (``offload="under_pressure"``: the engine's rule; its
        first selection is drawn all the same, as the engine's hooks draw it)."""
        tokens = sum(n for _, n in step.batch)
        warm = [(r, n) for (r, n), f in zip(step.batch, step.finishing, strict=True) if f]
        pcie = warm_bytes = 0.0
        if warm and self.kv.hisparse:
            kv = self.kv

            def cold(r: Request, n: int) -> bool:
                return kv.needs_warm_start(r.req_id, r.num_computed + n)

            # a first selection holds min(top_k, length) positions: no replay needed to count
            rows = sum(self._first_selection(r.num_computed + n) for r, n in warm
                       if not self._sampled(r) and cold(r, n))  # fmt: skip
            per_leader: list[float] = [float(rows)] * len(self.leaders)
            reqs = [r for r, _ in warm if self._sampled(r)]
            lens = [r.num_computed + n for r, n in warm if self._sampled(r)]
            keep = np.array([cold(r, n) for r, n in warm if self._sampled(r)], dtype=bool)
            for li in range(len(self.leaders) if reqs else 0):
                slots, sel = self._select(li, reqs, lens)
                if keep.any():
                    self.hot[li].step(slots[keep], sel[keep])
                    per_leader[li] += int((sel[keep] >= 0).sum())
            warm_bytes, pcie = self._traffic(per_leader)
        secs = tokens / self.s.prefill_tok_s + pcie
        return dict(warm_bytes=warm_bytes, pcie=pcie, secs=secs)

    def forward(self, part: ScheduledStep) -> dict[str, float]:
        """One forward's simulated statistics (``secs``: its time)."""
        return self._decode(part) if part.decode else self._prefill(part)

    def finish(self, part: ScheduledStep, st: dict[str, float], t0: float) -> list[float]:
        """The forward's tokens reach the scheduler at ``self.clock``; its `STEP_COLUMNS` row."""
        sched = self.sched
        sampled = [r for (r, _), f in zip(part.batch, part.finishing, strict=True)
                   if part.decode or f]  # fmt: skip
        n = len(sampled)
        out = ModelOutput(sampled, [0] * n, [None] * n, self.clock)
        if part.drafts is not None:  # each draft taken while the draws say so
            p, draw = self.s.spec_acceptance, self._accept
            taken = [next((j for j in range(len(d)) if draw.random() >= p), len(d))
                     for d in part.drafts]  # fmt: skip
            out.accepted = [[0] * t for t in taken]
            out.accepted_logprobs = [[None] * t for t in taken]
        sched.update_from_output(part, out)
        return [
            round(t0, 6), float(part.decode), sum(n for _, n in part.batch),
            len(part.batch) if part.decode else len(sched.running), len(sched.waiting),
            st.get("hits", 0.0), st.get("misses", 0.0), st.get("bytes", 0.0),
            st.get("warm_bytes", 0.0), round(st["pcie"], 9), round(st["secs"], 9),
        ]  # fmt: skip

    def _prompt(self, i: int, n: int) -> list[int]:
        """Request ``i``'s ``n`` prompt tokens: the shared document's first, then its own
        (without the cache a range stands for them: only its length is read)."""
        shared = min(self.s.shared_prefix, n)
        if not self.s.enable_prefix_caching:
            return range(n)  # type: ignore[return-value]
        own = (1 << 40) + i * self.s.max_model_len
        if not shared:  # a range: 128K-token prompts of a large trace need no lists
            return range(own, own + n)  # type: ignore[return-value]
        return list(range(shared)) + list(range(own, own + n - shared))

    # --- a whole trace ----------------------------------------------------------------
    def run(
        self, trace: list[TraceRequest], progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Every request of ``trace`` to the end; the bench's summary names plus the
        simulator's own (admission waits, PCIe time) and one row per step."""
        t_wall = time.perf_counter()
        sched, total = self.sched, len(trace)
        self.clock = 0.0
        self.admitted: dict[str, float] = {}
        reqs: list[Request] = []
        steps: list[list[float]] = []
        i = stalls = done = 0
        while i < total or sched.has_work:
            while i < total and trace[i].arrival <= self.clock:
                t = trace[i]
                req = (_SimRequest if self.s.num_speculative_tokens else Request)(
                    req_id=str(self.s.id_offset + i),
                    prompt_token_ids=self._prompt(i, t.input_len),
                    params=SamplingParams(temperature=0, max_tokens=t.output_len, ignore_eos=True),
                )
                req.metrics.arrival = t.arrival
                sched.add(req)
                reqs.append(req)
                i += 1
            if not sched.has_work:
                self.clock = trace[i].arrival
                continue
            parts = sched.schedule().parts
            self._lease_resets()
            if not parts:
                stalls += 1
                if stalls > total + 2:
                    raise RuntimeError("scheduler stalled: nothing fits and nothing runs")
                continue
            stalls = 0
            for part in parts:
                t0 = self.clock
                st = self.forward(part)
                self.clock += st["secs"]
                steps.append(self.finish(part, st, t0))
            sched.failed.clear()
            new_done = len(reqs) - len(sched.running) - len(sched.waiting)  # O(1) a step
            if progress is not None and new_done > done:
                progress(new_done, total)
            done = new_done
        return self._summary(reqs, steps, time.perf_counter() - t_wall)

    def _summary(
        self, reqs: list[Request], steps: list[list[float]], wall: float
    ) -> dict[str, Any]:
        dec = [s for s in steps if s[1]]
        dec_s = sum(s[10] for s in dec)
        hits, misses = sum(s[5] for s in dec), sum(s[6] for s in dec)
        nbytes = sum(s[7] for s in dec)
        waits = [self.admitted[r.req_id] - r.metrics.arrival for r in reqs
                 if r.req_id in self.admitted]  # fmt: skip
        ttft = [r.metrics.ttft for r in reqs if r.metrics.ttft is not None]

        def pct(v: list[float], q: float) -> float | None:
            return float(np.percentile(v, 100 * q)) if v else None

        return dict(
            placement=self.s.placement,
            requests=len(reqs),
            completed=sum(r.finish_reason == "length" for r in reqs),
            errors=[r.error for r in reqs if r.error],
            preemptions=sum(r.metrics.preemptions for r in reqs),
            peak_running=max((int(s[3]) for s in dec), default=0),
            mean_running=float(np.mean([s[3] for s in dec])) if dec else 0.0,
            decode_steps=len(dec),
            decode_seconds=dec_s,
            decode_tok_s=sum(s[2] for s in dec) / dec_s if dec_s > 0 else 0.0,
            prefill_tokens=sum(s[2] for s in steps if not s[1]),
            cached_tokens=sum(r.metrics.cached_tokens for r in reqs),
            hits=hits,
            misses=misses,
            hit_rate=hits / (hits + misses) if hits + misses else None,
            bytes_swapped=nbytes,
            warm_start_bytes=sum(s[8] for s in steps),
            h2d_gb_s=nbytes / dec_s / 1e9 if dec_s > 0 else 0.0,
            pcie_seconds=sum(s[9] for s in dec),
            pcie_fraction=sum(s[9] for s in dec) / dec_s if dec_s > 0 else 0.0,
            simulated_seconds=self.clock,
            admission_wait_p50=pct(waits, 0.5),
            admission_wait_p95=pct(waits, 0.95),
            admission_wait_max=max(waits, default=None),
            ttft_p50=pct(ttft, 0.5),
            ttft_p95=pct(ttft, 0.95),
            gpu_blocks=self.kv.gpu_blocks.num_usable,
            gpu_blocks_per_request=self.kv.gpu_need(self.s.max_model_len),
            leaders_simulated=len(self.leaders),
            sample_requests=self.s.sample_requests,
            leaders=len(self.group_bytes),
            wall_seconds=wall,
            step_columns=list(STEP_COLUMNS),
            steps=steps,
        )


class _SimRequest(Request):
    """A simulated request while speculating: its proposer reads no tokens (`_Drafts`), so
    the scheduler's ``all_token_ids`` is empty (a prompt here may be a ``range`` of 128K
    stand-ins, which a copy per step would not afford)."""

    @property
    def all_token_ids(self) -> list[int]:
        return []


class _Drafts:
    """The simulator's proposer: k placeholder drafts whenever the scheduler asks (how many
    it takes is `SimSettings.spec_acceptance`'s draw)."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [0] * k


#: what each row of ``steps`` holds
STEP_COLUMNS = (
    "t", "decode", "tokens", "running", "waiting", "hits", "misses", "bytes_swapped",
    "warm_start_bytes", "pcie_seconds", "seconds",
)  # fmt: skip


def simulate(
    settings: SimSettings,
    trace: list[TraceRequest],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Play ``trace`` through a fresh simulated engine of ``settings``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-step tensors: threads cost more than they give
    try:
        return Simulator(settings).run(trace, progress)
    finally:
        torch.set_num_threads(threads)
