"""The server's Prometheus metrics (``/metrics``), updated by the engine loop after each step.

Names follow vLLM's where one exists (``vllm:`` becomes ``hisparse:``): running and waiting
requests, preemptions, prompt and generation tokens, time to first token and inter-token
latency; and HiSparse's own: hot-buffer hits and misses, rows and bytes swapped in from the
host pool, host and GPU pool blocks in use; speculative decoding's drafts verified and
accepted (vLLM's ``spec_decode_*`` counters). The swap counters live on the device; the loop
reads them at most every ``flush_every`` seconds or when a request finishes (one copy each).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hisparse.engine.request import Request

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str, *, flush_every: float = 1.0) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.running = Gauge("hisparse:num_requests_running", "Requests running", label, registry=r)
        self.waiting = Gauge(
            "hisparse:num_requests_waiting",
            "Requests waiting (sequences: a request with n completions counts n)",
            label,
            registry=r,
        )
        self.preemptions = Counter(
            "hisparse:num_preemptions", "Requests preempted (recomputed later)", label, registry=r
        )
        self.aborted = Counter("hisparse:request_aborted", "Requests aborted", label, registry=r)
        self.demotions = Counter(
            "hisparse:num_demotions",
            "Requests whose older pages went to the host to make room (offload=under_pressure)",
            label,
            registry=r,
        )
        self.prefix_queries = Counter(
            "hisparse:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            label,
            registry=r,
        )
        self.prefix_hits = Counter(
            "hisparse:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not prefilled)",
            label,
            registry=r,
        )
        self.finished = Counter(
            "hisparse:request_success", "Requests finished", [*label, "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "hisparse:prompt_tokens", "Prompt tokens of finished requests", label, registry=r
        )
        self.generation_tokens = Counter(
            "hisparse:generation_tokens", "Tokens generated", label, registry=r
        )
        self.ttft = Histogram(
            "hisparse:time_to_first_token_seconds",
            "Time to first token",
            label,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "hisparse:inter_token_latency_seconds",
            "Time between two tokens of a request",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.hits = Counter("hisparse:cache_hits", "Hot-buffer hits (rows)", label, registry=r)
        self.misses = Counter(
            "hisparse:cache_misses", "Hot-buffer misses (rows swapped in)", label, registry=r
        )
        self.h2d_bytes = Counter(
            "hisparse:host_to_device_bytes",
            "KV bytes swapped in from the host pool",
            label,
            registry=r,
        )
        self.host_used = Gauge(
            "hisparse:host_pool_blocks_used", "Host pool blocks in use", label, registry=r
        )
        self.host_total = Gauge(
            "hisparse:host_pool_blocks_total", "Host pool blocks", label, registry=r
        )
        self.gpu_used = Gauge(
            "hisparse:gpu_pool_blocks_used", "GPU pool blocks in use", label, registry=r
        )
        self.gpu_total = Gauge(
            "hisparse:gpu_pool_blocks_total", "GPU pool blocks", label, registry=r
        )
        #: speculative decoding (vLLM's names): steps that verified drafts, drafts, accepted
        self.spec = {
            "spec_steps": Counter("hisparse:spec_decode_num_drafts",
                                  "Request steps that verified drafts", label, registry=r),
            "spec_drafted": Counter("hisparse:spec_decode_num_draft_tokens",
                                    "Draft tokens verified", label, registry=r),
            "spec_accepted": Counter("hisparse:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted", label, registry=r),
        }  # fmt: skip
        self._seen_spec: dict[str, tuple[int, int, int]] = {}
        self.model = model_name
        for counter in self.spec.values():
            self._l(counter)  # on /metrics at 0 from the start
        self.flush_every = flush_every
        self._last_flush = time.monotonic()
        self._seen_tokens: dict[str, int] = {}
        #: the requests behind those ids (an aborted one never comes back changed), held
        #: weakly: the server's metrics must not keep a request alive after the engine drops it
        self._tracked: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()
        self._seen_demotions = 0
        self._seen_prefix = (0, 0)

    def _l(self, metric):
        return metric.labels(model_name=self.model)

    def gauges(self, llm, waiting: int | None = None, aborted: int = 0) -> Any:
        """Running and waiting requests, pool blocks in use, aborts: what an abort changes
        between steps (engine thread; called after aborts too, so that a request whose
        client left no longer shows as running while the engine idles). ``waiting``: the
        sequences queued (the server counts those it still holds); default the
        scheduler's."""
        g = llm.engine_gauges()  # the node's under data parallelism: every rank summed
        self._l(self.running).set(g.running)
        self._l(self.waiting).set(g.waiting if waiting is None else waiting)
        if aborted:
            self._l(self.aborted).inc(aborted)
        self._l(self.gpu_total).set(g.gpu_total)
        self._l(self.gpu_used).set(g.gpu_used)
        if g.host_total:
            self._l(self.host_total).set(g.host_total)
            self._l(self.host_used).set(g.host_used)
        if aborted and not (g.running or g.waiting):
            self._flush(llm, time.monotonic())  # the last requests left: let go of them
        return g

    def after_step(
        self, llm, changed: list[Request], aborted: int = 0, waiting: int | None = None
    ) -> None:
        """Update everything from the engine's state after one step (engine thread)."""
        g = self.gauges(llm, waiting, aborted)
        # every step, by 0 too: the series is on /metrics from the start
        self._l(self.demotions).inc(g.demotions - self._seen_demotions)
        self._seen_demotions = g.demotions
        seen = (g.prefix_queries, g.prefix_hits)
        self._l(self.prefix_queries).inc(seen[0] - self._seen_prefix[0])
        self._l(self.prefix_hits).inc(seen[1] - self._seen_prefix[1])
        self._seen_prefix = seen
        any_done = False
        for req in changed:
            key = req.req_id
            m = req.metrics
            if m.spec_steps:
                now_spec = (m.spec_steps, m.spec_drafted, m.spec_accepted)
                before = self._seen_spec.get(key, (0, 0, 0))
                for name, a, b in zip(self.spec, now_spec, before, strict=True):
                    self._l(self.spec[name]).inc(a - b)
                if req.finished:
                    self._seen_spec.pop(key, None)
                else:
                    self._seen_spec[key] = now_spec
            seen = self._seen_tokens.get(key, 0)
            times = req.metrics.token_times
            new = len(req.output_token_ids) - seen
            if new > 0:
                self._l(self.generation_tokens).inc(new)
                if seen == 0 and req.metrics.ttft is not None:
                    self._l(self.ttft).observe(req.metrics.ttft)
                for a, b in zip(times[max(seen - 1, 0) : -1], times[max(seen, 1) :], strict=True):
                    self._l(self.itl).observe(b - a)
            if req.finished:
                any_done = True
                self._seen_tokens.pop(key, None)
                self._tracked.pop(key, None)
                self.finished.labels(self.model, req.finish_reason or "unknown").inc()
                self._l(self.prompt_tokens).inc(len(req.prompt_token_ids))
                if req.metrics.preemptions:
                    self._l(self.preemptions).inc(req.metrics.preemptions)
            else:
                self._seen_tokens[key] = len(req.output_token_ids)
                self._tracked[key] = req
        if len(self._seen_tokens) > g.running + g.waiting:
            # aborted requests never come back finished: forget them (and their ids); every
            # rank's requests count (a data-parallel rank's are mirrors on this one)
            live = {k for k, r in list(self._tracked.items()) if not r.finished}
            for k in set(self._tracked) - live:
                self._tracked.pop(k, None)
            self._seen_tokens = {k: v for k, v in self._seen_tokens.items() if k in live}
            self._seen_spec = {k: v for k, v in self._seen_spec.items() if k in live}
        now = time.monotonic()
        if any_done or not (g.running or g.waiting) or now - self._last_flush >= self.flush_every:
            self._flush(llm, now)

    def _flush(self, llm, now: float) -> None:
        """Read the runner's recorded hit/miss counters. Also when the engine goes idle: the
        recorded steps hold their requests, so an aborted one would outlive the engine's
        hold on it until the next flush."""
        self._last_flush = now
        for row in llm.runner.flush_metrics():
            self._l(self.hits).inc(row.get("hits", 0))
            self._l(self.misses).inc(row.get("misses", 0))
            self._l(self.h2d_bytes).inc(row.get("bytes_swapped", 0))
