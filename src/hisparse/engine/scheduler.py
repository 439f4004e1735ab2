"""Continuous batching with chunked prefill, admission that counts future tokens, and
preemption with recompute.

Each engine step spends a token budget (``max_num_batched_tokens``): first one token for every
decoding request, then chunks of admitted prompts in admission order (the usual chunked-prefill
policy, so a long prompt never stalls the running requests' tokens). The two parts run as two
forwards of one step: the decode part keeps its fixed-shape (CUDA-graph) path. New requests
join between steps.
Admission reserves host blocks for the prompt *and* every token the request may still
generate, so the host pool never overflows: a full pool means waiting. The GPU pool is checked
for what the request holds at its peak, `KVLayout.gpu_blocks_per_request` (the planner's own
figure: a HiSparse prefill streams its pages to the host, so it holds what its decode will)
one page past its length (`KVCacheManager.reserved_len`), beside what the admitted requests
may still take up to that length: a prompt its pages, a decode the page it opens at the next
boundary. Growth beyond is optimistic: when a decode step cannot grow, the most recently
admitted request is preempted (its blocks freed, its tokens recomputed later): its
recompute holds what it held, so it always fits again. With ``offload="under_pressure"`` the
requests keep older pages resident while the pool has room; those blocks count as free for
admission, and a request that needs them first demotes others (their older pages to the
host, `demote`) before anything waits or is preempted.

The scheduler issues no device work and imports no torch: `schedule` returns a
`SchedulerOutput` (plain data: the forwards, the block-table changes the KV accounting
recorded, the pages to copy to the host), the runner executes it, and `update_from_output`
takes each forward's sampled tokens in one place.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from hisparse.engine.kv_blocks import KVBlockManager, KVCapacityError
from hisparse.engine.output_processor import OutputProcessor
from hisparse.engine.request import Request, Status
from hisparse.engine.speculative import SpeculativeConfig
from hisparse.engine.step_data import ModelOutput, ScheduledStep, SchedulerOutput, WriteBack

#: ``mixed``: decodes first, prefill chunks in the budget left; ``prefill-first``: prompt
#: chunks alone while any prompt is unfinished (decodes wait)
SCHEDULE_POLICIES = ("mixed", "prefill-first")


class Scheduler:
    def __init__(
        self,
        kv: KVBlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "mixed",
        stops: OutputProcessor | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """``stops``: the output processor (the token, the text, stops; default: no text and
        no limit of length); ``speculative``: decode steps bring each request's drafts."""
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule={policy!r}: use one of {SCHEDULE_POLICIES}.")
        self.policy = policy
        self.stops = stops or OutputProcessor(None, set(), 1 << 62)
        self.kv = kv
        #: pages to copy to the host before the next forward (the lazy mirror)
        self._write_backs: list[WriteBack] = []
        #: requests whose older pages went to the host to make room (``under_pressure``)
        self.demotions = 0
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.failed: list[Request] = []
        self.speculative = speculative
        self.proposer = speculative.proposer() if speculative is not None else None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fail(self, req: Request, message: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = "error"
        req.error = message
        if req.metrics.finished is None:
            req.metrics.finished = time.perf_counter()
        self.failed.append(req)

    def fail_running(self, req: Request, message: str) -> None:
        """End one admitted request with an error and free its blocks; the others go on."""
        self._fail(req, message)
        self._release(req)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is (waiting or admitted) and free its blocks."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, "abort")

    def _admit(self) -> None:
        kv = self.kv
        promised = None
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            total, need_gpu = self._need(req)
            if promised is None:
                promised = self._promised()
            if need_gpu > kv.gpu_blocks.num_usable:
                self.waiting.popleft()
                self._fail(
                    req,
                    f"the prompt needs {need_gpu} GPU KV blocks but the GPU pool has "
                    f"{kv.gpu_blocks.num_usable}; raise gpu_memory_gib or shorten the prompt.",
                )
                continue
            if self._must_wait(total, need_gpu, promised) or self._prefilled_elsewhere(req):
                break
            # demotions leave `promised` as it is: it counts no reclaimable block
            while need_gpu > kv.gpu_blocks.num_free - promised and self.demote():
                pass
            if need_gpu > kv.gpu_blocks.num_free - promised:
                break
            try:
                kv.admit(req.req_id, total, self._lookup(req))
                kv.lease_hot(req.req_id)
            except KVCapacityError:
                kv.free(req.req_id)
                break  # a pool is full for now: wait for a request to finish
            self.waiting.popleft()
            self._start_after_hit(req)
            req.status = Status.PREFILLING
            self.running.append(req)
            promised += self._promise(req)

    def _lookup(self, req: Request) -> list[int]:
        """The cached blocks of the longest prefix of ``req``'s tokens in the prefix cache,
        whole pages, short of its last token (its step must compute one token at least to
        give logits)."""
        cache = self.kv.prefix_cache
        if cache is None:
            return []
        pages = (req.num_tokens - 1) // self.kv.block_size
        return cache.lookup(cache.hashes(req.page_hashes, pages, req.token_slice))

    def _prefilled_elsewhere(self, req: Request) -> bool:
        """The first page of ``req`` the prefix cache lacks is being prefilled by a running
        request (a sibling of ``n > 1``, a prompt of the same batch over one document):
        ``req`` waits for it to be cached instead of computing it again."""
        cache = self.kv.prefix_cache
        if cache is None:
            return False
        pages = (req.num_tokens - 1) // self.kv.block_size
        hashes = cache.hashes(req.page_hashes, pages, req.token_slice)
        k = len(cache.lookup(hashes))
        if k >= len(hashes):
            return False
        h = hashes[k]
        return any(
            r.status is Status.PREFILLING and h in r.page_hashes[k : k + 1] for r in self.running
        )

    def _start_after_hit(self, req: Request) -> None:
        """An admitted request computes from the end of the pages the cache gave it; its
        first admission counts the prompt tokens looked up and found (`PrefixCache`)."""
        cache = self.kv.prefix_cache
        if cache is None:
            return
        hit = self.kv.requests[req.req_id].shared_pages * self.kv.block_size
        req.num_computed = hit
        if req.metrics.preemptions == 0:
            req.metrics.cached_tokens = hit
            cache.record_query(len(req.prompt_token_ids), hit)

    def _cache_pages(self, req: Request) -> None:
        """Register ``req``'s computed full pages in the prefix cache (a lazy mirror writes
        their decode rows back first: a cached host block must hold every row; MTP: but the
        last computed row, which its next step rewrites, `MtpProposer.rewrites`)."""
        kv, cache = self.kv, self.kv.prefix_cache
        if cache is None or req.req_id not in kv.requests:
            return
        done = req.num_computed - getattr(self.proposer, "rewrites", 0)
        if (pages := done // kv.block_size) <= kv.requests[req.req_id].cached_pages:
            return
        hashes = cache.hashes(req.page_hashes, pages, req.token_slice)
        new = kv.cache_pages(req.req_id, hashes, done)
        if new and kv.hisparse and not kv.config.eager_host_mirror:
            host = kv.requests[req.req_id].host
            for gi, pgs, blocks in kv.clean_pages(req.req_id, new):
                self._write_backs.append(WriteBack(gi, blocks, [host[p] for p in pgs]))

    def _total(self, req: Request) -> int:
        """The most tokens ``req`` can reach."""
        return min(req.max_total_tokens, self.kv.max_blocks * self.kv.block_size)

    def _promise(self, r: Request) -> int:
        """GPU blocks admitted request ``r`` may still take of its plan's need at the length
        admission reserved for (`KVCacheManager.reserved_len`): spoken for. A prompt's
        streamed prefill takes its pages, a decode the page it opens at the next page
        boundary. Blocks kept beyond the plan (`KVCacheManager.reclaimable`) do not count as
        taken."""
        kv = self.kv
        need = kv.gpu_need(kv.reserved_len(r.num_tokens, self._total(r)))
        return max(need - kv.gpu_held(r.req_id) + kv.reclaimable(r.req_id, r.num_computed), 0)

    def _promised(self) -> int:
        """`_promise` summed over the admitted requests."""
        return sum(self._promise(r) for r in self.running)

    def schedule(self) -> SchedulerOutput:
        """The next engine step: its decode part (one token for every decoding request that
        can grow) and its prefill part (chunks of admitted prompts, in admission order, in the
        token budget the decodes leave). ``mixed`` (the default) schedules decodes first, so
        a long prompt arriving does not stall the others' tokens; ``prefill-first`` runs
        prefill chunks alone while any prompt is unfinished. Empty: nothing could run this
        time (a request was preempted or failed to make room)."""
        self._admit()
        # what the admitted requests are promised, once a step: pages kept beyond the plan
        # (under_pressure) leave it free. Growth in the step only lowers it, so the figure
        # stays on the safe side for the rest of the step. Summed when a growth first needs
        # it (a decode within its last page needs none: most steps need it not at all); the
        # decodes before that allocated nothing, so it is the figure of the step's start.
        promised: list[int] = []

        def reserve() -> int:
            if not promised:
                promised.append(self._promised() if self.kv.policy.under_pressure else 0)
            return promised[0]

        if self.policy == "prefill-first":
            prefill = self._prefill_part(self.max_num_batched_tokens, reserve)
            if prefill is not None:
                return self._output([prefill])
        decode = self._decode_part(reserve)
        budget = self.max_num_batched_tokens - (sum(n for _, n in decode.batch) if decode else 0)
        prefill = self._prefill_part(budget, reserve) if self.policy == "mixed" else None
        parts = [p for p in (decode, prefill) if p is not None]
        if not parts and self.running:
            # Prompts that cannot grow and nothing decoding: free the newest to progress.
            self.preempt(self.running[-1])
        return self._output(parts)

    def _output(self, parts: list[ScheduledStep]) -> SchedulerOutput:
        """``parts`` with everything the runner does before them: the table changes and slot
        resets the accounting recorded, and the pending write-backs."""
        updates, resets = self.kv.take_table_updates()
        write_backs, self._write_backs = self._write_backs + self.kv.take_page_fills(), []
        copies = self.kv.take_indexer_copies()
        return SchedulerOutput(parts, updates, resets, write_backs, copies)

    def _drop_resident(self, req: Request, dropped: list[tuple[int, list[int], list[int]]]) -> None:
        """Free resident pages ``dropped`` (`KVBlockManager.trim_resident`'s) of ``req``; where
        the mirror is lazy their decode rows are copied to the host first (a `WriteBack` the
        next forward's runner issues before it)."""
        kv = self.kv
        if not kv.config.eager_host_mirror:
            host = kv.requests[req.req_id].host
            for gi, pages, blocks in kv.dirty_pages(req.req_id, dropped):
                self._write_backs.append(WriteBack(gi, blocks, [host[p] for p in pages]))
        kv.release_resident(req.req_id, dropped)

    def _prefill_part(self, budget: int, reserve: Callable[[], int]) -> ScheduledStep | None:
        """Chunks of admitted prompts in admission order, in ``budget`` tokens. Under HiSparse
        a step's prefill reads every context page of its requests through the staging area
        (`PrefillStaging`): a chunk that would overflow it waits a step. None does in this
        order: only the first request of the part can be past its first chunk, and the area
        holds a ``max_model_len`` context plus one step's tokens."""
        batch: list[tuple[Request, int]] = []
        finishing: list[bool] = []
        kv = self.kv
        staged = 0
        for req in self.running:
            if req.status is not Status.PREFILLING or budget <= 0:
                continue
            remaining = req.num_tokens - req.num_computed
            n = min(remaining, budget)
            rows = kv.staging_rows(req.num_computed + n)
            if batch and staged + rows > kv.staging_capacity:
                break
            others = (
                reserve() - self._promise(req) if kv.policy.under_pressure else 0
            )  # the others' promise
            if not self._grow(req, req.num_computed + n, others):
                break
            staged += rows
            batch.append((req, n))
            finishing.append(n == remaining)
            budget -= n
        return ScheduledStep(decode=False, batch=batch, finishing=finishing) if batch else None

    def _decode_part(self, reserve: Callable[[], int]) -> ScheduledStep | None:
        """One token for every decoding request, and its drafts where speculating (in the
        token budget the one-token rows leave); a request that cannot grow drops its drafts,
        then preempts the newest request (itself when it is the newest) until it can."""
        batch: list[tuple[Request, int]] = []
        decoding = [r for r in self.running if r.status is Status.DECODING]
        spare = self.max_num_batched_tokens - len(decoding)  # tokens left for drafts
        drafts: dict[int, list[int]] = {}
        for req in decoding:
            if req.status is not Status.DECODING:
                continue  # preempted below for an earlier request
            d = self._drafts(req, spare)
            n = 1 + len(d)
            if not self.kv.needs_growth(req.req_id, req.num_computed + n):
                batch.append((req, n))  # within its last page: nothing to allocate
                drafts[id(req)], spare = d, spare - len(d)
                continue
            while True:
                if self._grow(req, req.num_computed + n, reserve()):
                    batch.append((req, n))
                    drafts[id(req)], spare = d, spare - len(d)
                    break
                if n > 1:  # no room for the drafts' rows: the one token alone
                    d, n = [], 1
                    if not self.kv.needs_growth(req.req_id, req.num_computed + 1):
                        batch.append((req, 1))
                        break
                    continue
                if len(self.running) == 1:
                    self.fail_running(req, "the GPU KV pool cannot hold this request alone")
                    break
                victim = self._victim(req)
                self.preempt(victim)
                batch = [(r, n) for r, n in batch if r is not victim]
                if victim is req:
                    break
        if not batch:
            return None
        step = ScheduledStep(decode=True, batch=batch, finishing=[False] * len(batch))
        if any(n > 1 for _, n in batch):
            step.drafts = [drafts.get(id(r), []) for r, _ in batch]
        return step

    def _drafts(self, req: Request, spare: int) -> list[int]:
        """``req``'s draft tokens for this step (speculative decoding): at most k, within
        ``spare`` tokens of the step's budget, and never past what the request may still
        produce (``max_tokens``, ``max_model_len``, its host reservation), since every
        accepted draft and the token after it become output."""
        spec, proposer = self.speculative, self.proposer
        if spec is None or proposer is None or spare <= 0 or req.grammar is not None:
            return []  # (a structured output's rows would need the grammar per row: none)
        left = min(self._total(req), self.stops.max_model_len) - req.num_tokens
        if req.params.max_tokens is not None:
            left = min(left, req.params.max_tokens - len(req.output_token_ids))
        k = min(spec.num_speculative_tokens, spare, left - 1)
        if k <= 0:
            return []
        if req.draft_pause > 0:
            req.draft_pause -= 1
            return []
        return proposer.propose(req.all_token_ids, k)

    def _grow(self, req: Request, new_len: int, reserve: int) -> bool:
        """`KVCacheManager.grow`, demoting other requests while that makes room; False: the
        pool cannot give it the blocks now. Pages kept beyond the plan leave ``reserve``
        blocks (what the other prompts are promised) free."""
        while True:
            try:
                self.kv.grow(req.req_id, new_len, reserve=reserve)
                return True
            except KVCapacityError:
                if not self.demote():
                    return False

    def demote(self) -> bool:
        """``offload="under_pressure"``: send the older resident pages of the request holding
        the most of them to the host (written back first where the mirror is lazy), so it
        reads them through its hot buffer from now on. False: no request has any."""
        kv = self.kv
        if not kv.policy.under_pressure:
            return False
        best = kv.policy.demotion_victim(
            [(r, kv.reclaimable(r.req_id, r.num_computed)) for r in self.running]
        )
        if best is None:
            return False
        dropped = kv.trim_resident(best.req_id, best.num_computed, demote=True)
        if not dropped:  # cannot be (reclaimable counts what trim drops): never loop on it
            return False
        self._drop_resident(best, dropped)
        self.demotions += 1
        return True

    def _victim(self, req: Request) -> Request:
        """The request to preempt so ``req`` can grow: the most recently admitted one
        (``req`` itself when it is the newest). Its recompute is a streamed prefill that
        holds what the request held (`KVLayout.gpu_blocks_per_request`), never more than one
        ``max_model_len`` request, which the plan guarantees the pool holds: it always fits
        again."""
        return self.running[-1]

    def preempt(self, req: Request) -> None:
        """Free everything; the request recomputes prompt + generated tokens later (what
        the prefix cache still holds of them, it takes back)."""
        self._cache_pages(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.metrics.preemptions += 1
        if req.metrics.tokens_before_first_preemption is None:
            req.metrics.tokens_before_first_preemption = len(req.output_token_ids)
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req.req_id)

    # --- after a step ran ---------------------------------------------------------------
    def continue_decode(self, batch: list[tuple[Request, int]]) -> SchedulerOutput | None:
        """The next decode of the requests of ``batch``, a decode step whose sampled tokens
        are still on the device (one per request, not yet appended): the same requests,
        one token each, in the same order. ``None`` where that is not the step `schedule`
        would make, or may not be: a waiting request could be admitted (`_admission_blocked`),
        a prompt is unfinished, a request left or may end by length with its pending token, or
        a request cannot grow without preempting another. The caller then reads the pending
        tokens and calls `schedule`. A request that grew here keeps its pages for that next
        step. Where a stop token read afterwards frees the room a waiting request needs, that
        request is admitted a step later than `schedule` would."""
        reqs = [req for req, _ in batch]
        if (
            self.speculative is not None  # the next drafts need the pending tokens
            or not self._admission_blocked()
            or len(reqs) != len(self.running)
            or any(r.status is not Status.DECODING for r in self.running)
            or set(map(id, reqs)) != set(map(id, self.running))
        ):
            return None
        for req in reqs:
            ends = req.params.max_tokens is not None and (
                len(req.output_token_ids) + 1 >= req.params.max_tokens
            )
            if ends or req.num_tokens + 1 >= self.stops.max_model_len:
                return None
        reserve = self._promised() if self.kv.policy.under_pressure else 0
        for req in reqs:
            if self.kv.needs_growth(req.req_id, req.num_computed + 1) and not self._grow(
                req, req.num_computed + 1, reserve
            ):
                return None
        step = ScheduledStep(
            decode=True, batch=[(r, 1) for r in reqs], finishing=[False] * len(reqs)
        )
        return self._output([step])

    def _admission_blocked(self) -> bool:
        """Whether `_admit` would admit nothing now, without admitting: no request waits, or
        ``max_num_seqs`` run, or the first waiting request lacks a slot, its host blocks or
        its GPU blocks beside what the running requests are promised, even after demoting
        every page that could be (`_must_wait`: `_admit`'s own test). The running requests'
        promise is taken from their recorded tokens, which may lag the computed ones by the
        tokens still on the device: it is then no larger than after reading them, so a
        "blocked" here is blocked there too (the other way round, the caller reads the tokens
        first)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return True
        total, need_gpu = self._need(self.waiting[0])
        if need_gpu > self.kv.gpu_blocks.num_usable:
            return False  # `_admit` fails it at once
        return self._must_wait(total, need_gpu, self._promised())

    def _need(self, req: Request) -> tuple[int, int]:
        """A waiting request's most tokens and the GPU blocks its admission needs."""
        total = self._total(req)
        return total, self.kv.gpu_need(self.kv.reserved_len(req.num_tokens, total))

    def _must_wait(self, total: int, need_gpu: int, promised: int) -> bool:
        """Whether a waiting request (its most tokens ``total``, GPU blocks ``need_gpu``)
        waits for a request to finish: no slot, no host blocks, or fewer GPU blocks beside
        ``promised`` than it needs even after demoting every page that could be
        (``offload="under_pressure"``; `_admit` demotes only where that makes the room)."""
        kv = self.kv
        if not kv.free_slots or not kv.host_fits(total):
            return True
        room = kv.gpu_blocks.num_free - promised
        if kv.policy.under_pressure:
            room += sum(kv.reclaimable(r.req_id, r.num_computed) for r in self.running)
        return need_gpu > room

    def update_from_output(self, step: ScheduledStep, out: ModelOutput) -> None:
        """What the forward of ``step`` changed, in one place: its tokens count as computed
        (`advance`), its sampled tokens are appended and stops checked (`record`), and the
        resident pages it no longer needs are dropped (`trim`); a step `launched` before its
        tokens were read did the first and the last then."""
        if not step.launched:
            self.advance(step, out)
        self.record(step, out.sample_reqs, out.tokens, out.logprobs, out.now, out)
        if not step.launched:
            self.trim(step)

    def launched(self, step: ScheduledStep) -> None:
        """Async scheduling: decode ``step`` is on the device and its tokens will be read a
        step later; what depends only on counts happens now (`advance`, `trim`), so the next
        step sees the tables it would see after reading the tokens."""
        self.advance(step)
        self.trim(step)
        step.launched = True

    def advance(self, step: ScheduledStep, out: ModelOutput | None = None) -> None:
        """The forward of ``step`` is under way: its tokens count as computed (written rows,
        positions), before its sampled tokens are known. A speculative step's request
        computed its last token and the drafts it took (``out.accepted``): the rows past
        them are rewritten by its next step."""
        accepted = out.accepted if out is not None and step.drafts is not None else None
        for i, (req, n) in enumerate(step.batch):
            if accepted is not None:
                n = 1 + len(accepted[i])
            if step.decode:
                self.kv.mark_written(req.req_id, req.num_computed, n)
            req.num_computed += n

    def trim(self, step: ScheduledStep) -> None:
        """The resident pages the requests of ``step`` no longer need once it ran (their rows
        are on the host: only the tail pages stay; a prefill streams its pages to the host
        chunk by chunk; nothing is trimmed on "gpu"), written back to the host first where
        the mirror is lazy (`_drop_resident`), then freed. Depends only on the counts, so an
        async decode trims at launch: the next step sees the tables it would see after
        reading the tokens. Tables and blocks change in stream order, after ``step``."""
        for req, _ in step.batch:
            if req.finished:
                continue
            self._cache_pages(req)
            dropped = self.kv.trim_resident(req.req_id, req.num_computed)
            if dropped:
                self._drop_resident(req, dropped)

    def record(
        self,
        step: ScheduledStep,
        sampled: list[Request],
        tokens: list[int | None],
        logprobs: list[dict[int, float] | None],
        now: float,
        out: ModelOutput | None = None,
    ) -> None:
        """The sampled token of each request in ``sampled`` (``None``: its logits were not
        finite, it fails alone), stops, and prompts that start decoding. Requests that
        finished meanwhile (a stop read from an earlier step, an abort) are passed over:
        their token was computed and is dropped. A speculative step's accepted drafts come
        first, token by token: a stop among them drops the rest."""
        spec = out is not None and out.accepted is not None and step.drafts is not None
        for i, (req, tok, lp) in enumerate(zip(sampled, tokens, logprobs, strict=True)):
            if req.finished:
                continue
            seq: list[tuple[int | None, dict[int, float] | None]] = [(tok, lp)]
            if spec:
                assert out is not None and out.accepted is not None
                taken = out.accepted[i]
                lps = out.accepted_logprobs[i] if out.accepted_logprobs else [None] * len(taken)
                seq = [*zip(taken, lps, strict=True), (tok, lp)]
                m = req.metrics
                m.spec_drafted += len(step.drafts[i])  # type: ignore[index]
                m.spec_accepted += len(taken)
                m.spec_steps += bool(step.drafts[i])  # type: ignore[index]
                if step.drafts[i] and getattr(self.proposer, "pauses", True):  # type: ignore[index]
                    pause_drafts(req, bool(taken))
            for t, p in seq:
                if t is None:
                    req.metrics.finished = now
                    self.fail_running(
                        req, "sampling failed: this request's logits are not finite numbers"
                    )
                    break
                if req.grammar is not None and not req.grammar.accept_token(t):
                    req.metrics.finished = now
                    self.fail_running(req, f"structured output: token {t} breaks the grammar")
                    break
                reason = self.stops.append(req, t, p, now)
                if reason is not None:
                    req.metrics.finished = now
                    self.finish(req, reason)
                    break
        for (req, _), fin in zip(step.batch, step.finishing, strict=True):
            if req.finished:
                continue
            if step.decode or fin:
                req.status = Status.DECODING

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._cache_pages(req)
        self._release(req)


#: Most decode steps a request runs without drafts after its drafts kept being refused.
MAX_DRAFT_PAUSE = 8


def pause_drafts(req: Request, accepted: bool) -> None:
    """After a step that verified drafts of ``req``: where none was taken, its next
    ``draft_backoff`` decode steps draft nothing (1, 2, 4, ... up to `MAX_DRAFT_PAUSE` while
    refusals go on); a taken draft resets it. A verifying step costs more than a one-row
    step (the CPU's batch-1 step most of all), so where lookups keep missing (open-ended
    text) speculation stops paying for rows nobody takes, and it drafts again soon enough
    when the request starts copying. The tokens do not depend on it."""
    if accepted:
        req.draft_pause, req.draft_backoff = 0, 1
        return
    req.draft_pause = req.draft_backoff
    req.draft_backoff = min(2 * req.draft_backoff, MAX_DRAFT_PAUSE)
