"""The server's metrics hold no request alive: after the engine drops an aborted request,
nothing of `ServerMetrics` refers to it (the soak's "no engine request left alive" rests on
it, whether or not another step follows the abort)."""

from __future__ import annotations

import gc

import pytest

from hisparse import LLM, SamplingParams
from hisparse.engine.request import Request

pytest.importorskip("prometheus_client")

from hisparse.serve.metrics import ServerMetrics


def test_an_aborted_request_is_not_kept_alive_by_the_metrics(tiny_checkpoint):
    metrics = ServerMetrics("tiny")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(tiny_checkpoint("deepseek_v32"), device="cpu", max_model_len=64) as llm:
        llm.add_request(list(range(2, 12)), params, request_id="kept")
        metrics.after_step(llm, llm.step())  # prefilled and running: its tokens are tracked
        metrics.after_step(llm, llm.step())
        assert llm.abort_request("kept")
        metrics.gauges(llm, aborted=1)  # what the server does after an abort; no step follows
        gc.collect()
        assert not [o for o in gc.get_objects() if type(o) is Request and o.req_id == "kept"]
        # a later step forgets the aborted request's count too
        llm.add_request(list(range(2, 8)), params, request_id="next")
        metrics.after_step(llm, llm.step())
        assert "kept" not in metrics._seen_tokens
