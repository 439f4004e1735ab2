"""`hisparse bench` and its benchmark-only modes on tiny DSA checkpoints (CPU).

Top-k replay and synthetic prefill apply to both placements alike, so HiSparse must still give
the all-GPU tokens and see exactly the same replayed selections; the replay must realize the
overlap asked for; the CLI writes its JSON and refuses bad arguments with a clear message.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.bench.hooks import BenchHooks
from hisparse.bench.replay import replay_step
from hisparse.cli import main
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

TOP_K = 16  # the tiny preset's index_topk
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def _prompts(lengths=(90, 61, 120), seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _run(path, placement, *, overlap=0.8, synthetic=True, seed=0, batched=2048, offload=None):
    cfg = HiSparseConfig(host_pool_gib=0.01, block_size=4, device_buffer_size=2 * TOP_K,
                         offload=offload)  # fmt: skip
    llm = LLM(
        path,
        kv_placement=placement,
        hisparse=cfg,
        kv_format="bf16",
        max_model_len=160,
        max_num_seqs=3,
        gpu_memory_gib=0.02,
        step_hooks=BenchHooks(
            topk_overlap=overlap, synthetic_prefill=synthetic, seed=seed, timing=True
        ),
        max_num_batched_tokens=batched,
    )
    assert llm.runner.hooks.replay is not None
    llm.runner.hooks.replay.log = []
    with llm:
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=PARAMS)
        log = llm.runner.hooks.replay.log
        stats = [s for s in llm.step_stats if s["decode"]]
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs, log, stats


def _by_request(log):
    """{(leader, request key): [(length, selection set)] in step order}."""
    out: dict = {}
    for leader, key, n, sel in log:
        out.setdefault((leader, key), []).append((n, set(sel[sel >= 0].tolist())))
    return out


@pytest.mark.parametrize("synthetic", [True, False], ids=["synthetic", "model-prefill"])
def test_replay_is_lossless_and_identical_between_placements(checkpoint, synthetic):
    gpu, gpu_log, _ = _run(checkpoint, "gpu", synthetic=synthetic)
    # offload="always": the replayed rows are read through the hot buffers
    hs, hs_log, hs_stats = _run(checkpoint, "hisparse", synthetic=synthetic, offload="always")
    assert [o.token_ids for o in hs] == [o.token_ids for o in gpu]
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in gpu)
    # the same selections, request by request and step by step (batch order aside)
    a, b = _by_request(gpu_log), _by_request(hs_log)
    assert a.keys() == b.keys() and a == b
    # the hot buffers served the replayed rows: misses swapped in, most rows hit
    hits = sum(o.metrics.hits for o in hs)
    misses = sum(o.metrics.misses for o in hs)
    assert misses > 0 and hits > misses
    assert sum(o.metrics.bytes_swapped for o in hs) > 0
    assert all("resolve_ms" in s and "gather_ms" in s for s in hs_stats)


def test_synthetic_prefill_warms_the_hot_buffer(checkpoint):
    """After a synthetic prefill the hot buffer holds the replayed last-prompt selection
    (copied from the resident pages, as after a real prefill): the first decode step of a
    request misses only the replaced part, about 1 - overlap of its rows."""
    _, _, stats = _run(checkpoint, "hisparse", overlap=0.75, offload="always")
    first = stats[0]  # every request decodes in the first decode step (all prefilled first)
    wanted = first["hits"] + first["misses"]
    assert first["misses"] / wanted <= 0.3
    assert stats[0]["bytes_swapped"] > 0


@pytest.mark.parametrize("overlap", [0.6, 0.8, 0.95])
def test_realized_overlap(checkpoint, overlap):
    _, log, _ = _run(checkpoint, "gpu", overlap=overlap)
    keep = min(round(overlap * TOP_K), TOP_K - 1)
    realized = []
    for steps in _by_request(log).values():
        for (n0, s0), (n1, s1) in itertools.pairwise(steps):
            assert n1 == n0 + 1 and len(s1) == TOP_K and max(s1) == n1 - 1
            realized.append(len(s0 & s1) / TOP_K)
    assert realized and all(r == keep / TOP_K for r in realized)
    assert abs(keep / TOP_K - overlap) <= 0.5 / TOP_K + 1e-9


def test_replay_step_is_valid_and_fills_short_contexts():
    K = 8
    prev = torch.full((3, K), -1, dtype=torch.int32)
    lens = torch.tensor([5, 9, 300])  # shorter than, just above and far above top_k
    keys = torch.tensor([7, 8, 9])
    for _ in range(30):
        out = replay_step(prev, lens, keys, seed=3, leader=0, keep=6, max_len=int(lens.max()))
        for r in range(3):
            sel = out[r][out[r] >= 0].tolist()
            n = int(lens[r])
            assert len(sel) == len(set(sel)) == min(n, K)
            assert max(sel) == n - 1 and min(sel) >= 0
            if n <= K:
                assert sorted(sel) == list(range(n))
            else:
                old = set(prev[r][prev[r] >= 0].tolist())
                # enough fresh positions: exactly `keep` kept; else refilled from the old set
                fresh_room = n - 1 - len(old)
                expect = 6 if fresh_room >= K - 1 - 6 else K - 1 - fresh_room
                assert len(old & set(sel)) == (expect if old else 0)
        prev, lens = out, lens + 1
    again = replay_step(prev, lens, keys, seed=3, leader=0, keep=6, max_len=int(lens.max()))
    assert torch.equal(
        again, replay_step(prev, lens, keys, seed=3, leader=0, keep=6, max_len=int(lens.max()))
    )
    other = replay_step(prev, lens, keys, seed=4, leader=0, keep=6, max_len=int(lens.max()))
    assert not torch.equal(again, other)


def _bench_argv(ckpt, tmp_path, *extra):
    return [
        "bench",
        "--model",
        str(ckpt),
        "--input-len",
        "70",
        "--output-len",
        "6",
        "--concurrency",
        "1,3",
        "--gpu-memory-gib",
        "0.01",
        "--kv-format",
        "bf16",
        "--block-size",
        "4",
        "--hot-buffer",
        "32",
        "--no-warmup",
        "--json",
        str(tmp_path / "bench.json"),
        "--plot",
        str(tmp_path / "bench.png"),
        *extra,
    ]


def test_bench_cli_writes_json(checkpoint, tmp_path, capsys):
    assert main(_bench_argv(checkpoint, tmp_path, "--offload", "always")) == 0
    text = capsys.readouterr().out
    assert "TTFT NOT measured" in text and "HiSparse / all-GPU" in text
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["ttft_measured"] is False
    rows = {(r["placement"], r["concurrency"]): r for r in doc["results"]}
    assert set(rows) == {("hisparse", 1), ("hisparse", 3), ("gpu", 1), ("gpu", 3)}
    for r in rows.values():
        assert r["completed"] == r["requests"] and r["decode_tok_s"] > 0
        assert r["ttft_p50"] is None and r["tpot_p50"] > 0
        # steady state: the median rate of the steps that ran every admitted request
        assert r["peak_steps"] > 0 and r["peak_decode_tok_s"] > 0
        # the step log: [decode?, running, ms] per step, its decode steps the counted ones
        decode_ms = [ms for d, _, ms in r["step_log"] if d]
        assert len(decode_ms) == r["decode_steps"] and all(ms > 0 for ms in decode_ms)
        assert abs(sum(decode_ms) / 1e3 - r["decode_seconds"]) < 1e-3 * len(decode_ms)
        # requests holding KV at once: every step's count, prefill steps' all admitted
        assert r["peak_admitted"] == max(n for _, n, _ in r["step_log"])
        assert r["peak_running"] <= r["peak_admitted"] <= r["concurrency"]
        # the host pool the engine sized (HiSparse only), for `hisparse simulate --compare`
        assert (r["host_pool_gib"] is not None) == (r["placement"] == "hisparse")
    assert rows[("hisparse", 3)]["bytes_swapped"] > 0 and rows[("gpu", 3)]["hit_rate"] is None
    assert all(r["same_tokens"] is True for r in doc["ratios"]) and len(doc["ratios"]) == 2


def test_bench_offload_under_pressure(checkpoint, tmp_path, capsys, monkeypatch):
    """``--offload under_pressure``: the JSON rows say so and count demotions, the table
    labels the row, the tokens are all-GPU's."""
    monkeypatch.setenv("COLUMNS", "400")  # the table's rows on one line each
    argv = _bench_argv(checkpoint, tmp_path, "--offload", "under_pressure")
    assert main(argv) == 0
    assert " demoted)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "bench.json").read_text())
    hs = [r for r in doc["results"] if r["placement"] == "hisparse"]
    assert hs and all(r["offload"] == "under_pressure" and r["demotions"] >= 0 for r in hs)
    assert doc["settings"]["offload"] == "under_pressure"
    assert all(r["same_tokens"] is True for r in doc["ratios"])
    bad = _bench_argv(checkpoint, tmp_path, "--offload", "never")
    assert main(bad) == 2
    assert "--offload never: must be one of 'always', 'under_pressure'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--concurrency", "1,x", "positive integers"),
        ("--concurrency", "0", ">= 1"),
        ("--concurrency", "1,8,8", "'1,8,8': 8 is listed more than once"),
        ("--kv-placement", "disk", "use hisparse, gpu"),
        ("--kv-placement", "hisparse,gpu,hisparse", "hisparse is listed more than once"),
        ("--topk-overlap", "1.5", "fraction in \\[0, 1\\]"),
        ("--output-len", "1", "must be >= 2"),
        ("--gpu-memory-gib", "0", "must be a positive, finite"),
        ("--gpu-memory-gib", "inf", "must be a positive, finite"),
        ("--json", "{tmp}", "is a folder"),
        ("--plot", "{tmp}/a_file/plot.png", "is a file"),
    ],
)
def test_bad_arguments(tmp_path, capsys, flag, value, message):
    argv = [
        "bench",
        "--model",
        str(tmp_path),
        "--input-len",
        "10",
        "--output-len",
        "4",
        "--gpu-memory-gib",
        "1",
        flag,
        value.format(tmp=tmp_path),
    ]
    (tmp_path / "a_file").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hisparse bench: error:" in err
    assert pytest.importorskip("re").search(message, err), err


def _minimal_bench_argv(model, *extra):
    return ["bench", "--model", str(model), "--input-len", "10", "--output-len", "4",
            "--gpu-memory-gib", "1", *extra]  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-3"])
@pytest.mark.parametrize("flag", ["--max-batched-tokens", "--max-model-len"])
def test_zero_or_negative_token_limit_is_a_usage_error(tmp_path, capsys, flag, value):
    """0 used to stand silently for the default; omitting the option is the way to ask for it."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(_minimal_bench_argv(tmp_path, flag, value))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value} is not allowed: omit it for the default, or give a " in err


@pytest.mark.parametrize(
    ("extra", "max_len", "batched"),
    [
        ([], 14, 16384),
        (["--prefill", "model"], 14, 2048),
        (["--max-model-len", "20", "--max-batched-tokens", "7"], 20, 7),
    ],
)
def test_token_limits_default_when_omitted(tmp_path, extra, max_len, batched):
    from hisparse.bench.cli import parse_args_checked
    from hisparse.cli import build_parser

    (tmp_path / "config.json").write_text("{}")
    cfg = parse_args_checked(build_parser().parse_args(_minimal_bench_argv(tmp_path, *extra)))
    assert (cfg["max_len"], cfg["batched"]) == (max_len, batched)


@pytest.mark.parametrize(
    ("extra", "noted"),
    [(["--seed", "3"], True), (["--seed", "3", "--temperature", "0.7"], False), ([], False)],
)
def test_generate_notes_that_seed_is_unused_when_greedy(tmp_path, capsys, extra, noted):
    """A note, not an error: the run goes on (here to the missing model's error)."""
    assert main(["generate", "--model", str(tmp_path / "none"), *extra]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err
    note = "note: --seed has no effect with --temperature 0 (greedy decoding)"
    assert (note in err) is noted, err


def test_missing_model(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "--model",
                str(tmp_path / "none"),
                "--input-len",
                "10",
                "--output-len",
                "4",
                "--gpu-memory-gib",
                "1",
            ]
        )
        == 2
    )
    assert "no such file or folder" in capsys.readouterr().err


def test_same_tokens_compared_only_under_the_same_schedule():
    from hisparse.bench.report import ratio_rows

    def row(placement, tokens, schedule):
        return dict(placement=placement, concurrency=2, peak_running=2, decode_tok_s=1.0,
                    token_ids=tokens, schedule=schedule, preemptions=0)  # fmt: skip

    same = [(False, 10, 2), (True, 2, 2)]
    other = [(False, 5, 1), (False, 5, 2), (True, 2, 2)]  # admitted one step later
    assert ratio_rows([row("hisparse", [[1]], same), row("gpu", [[1]], same)])[0]["same_tokens"]
    assert (
        ratio_rows([row("hisparse", [[1]], same), row("gpu", [[2]], same)])[0]["same_tokens"]
        is False
    )
    assert (
        ratio_rows([row("hisparse", [[1]], same), row("gpu", [[2]], other)])[0]["same_tokens"]
        is None
    )


def test_warmup_batches_cover_every_graph_size_a_run_can_meet():
    """A cell of n requests ramps up and drains through the smaller padded decode sizes: each
    gets a warm-up cell, so no capture or kernel compile falls inside the timed run."""
    from types import SimpleNamespace

    from hisparse.bench.cell import warmup_batches
    from hisparse.engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(36, torch.device("cpu"), capture=False)
    llm = SimpleNamespace(runner=SimpleNamespace(graphs=graphs))
    assert warmup_batches(llm, 29) == [29]  # eager steps: nothing captured
    graphs.capture = True  # (as on CUDA; sizes 1, 2, 4, 8, 16, 32, 36)
    assert warmup_batches(llm, 29) == [1, 2, 4, 8, 16, 29]
    assert warmup_batches(llm, 36) == [1, 2, 4, 8, 16, 32, 36]
    assert warmup_batches(llm, 1) == [1]
    assert warmup_batches(SimpleNamespace(runner=SimpleNamespace(graphs=None)), 5) == [5]


def test_keep_step_state_rewinds_the_replayed_selection():
    """`BenchHooks.keep_step_state`: a decode step repeated after the rewind (as
    `DecodeGraphs.run` repeats one to compile the other kind of graph) selects what the step
    selected, and leaves the replay where one step leaves it."""
    from hisparse.bench.replay import TopKReplay
    from hisparse.engine.hooks import StepRequests

    hooks = BenchHooks(topk_overlap=0.5)
    hooks.replay = TopKReplay(top_k=8, overlap=0.5, seed=3, num_leaders=1, max_slots=3,
                              device=torch.device("cpu"))  # fmt: skip
    hooks.replay.log = []
    reqs = StepRequests(slots=torch.tensor([0, 2]), lens=torch.tensor([40, 57]),
                        keys=torch.tensor([11, 12]), max_len=57)  # fmt: skip
    topk = torch.empty((2, 8), dtype=torch.int32)  # the model's own selection, replaced
    hooks.decode_topk(0, topk, reqs)  # a first step: the state to rewind to
    rewind = hooks.keep_step_state()
    first = hooks.decode_topk(0, topk, reqs).clone()
    after = hooks.replay.prev.clone()
    rewind()
    again = hooks.decode_topk(0, topk, reqs)
    assert torch.equal(again, first) and torch.equal(hooks.replay.prev, after)
    assert len(hooks.replay.log) == 4  # two steps of two requests, the repeat not doubled
    assert not torch.equal(hooks.decode_topk(0, topk, reqs), first)  # it moves on


def test_bench_shared_prefix_prefills_the_document_once_per_cell(checkpoint, tmp_path, capsys):
    """``--shared-prefix 64``: the three prompts of a cell start with one document; with
    prefix caching the first request prefills it and the other two start after it."""
    argv = _bench_argv(checkpoint, tmp_path, "--shared-prefix", "64", "--kv-placement", "hisparse")
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["concurrency"]: r for r in doc["results"]}
    assert rows[1]["cached_tokens"] == 0 and rows[1]["prefill_tokens"] == 70
    assert rows[3]["cached_tokens"] == 2 * 64 and rows[3]["prefill_tokens"] == 3 * 70 - 2 * 64


def test_bench_speculative_counts_the_drafts_and_keeps_the_tokens(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    """``--speculative-config`` with the model's own top-k and prefill: the JSON and the table
    count the drafts, and every cell's tokens equal the run without speculation; with the
    replayed top-k it is refused, naming the flags to add."""
    monkeypatch.setenv("COLUMNS", "400")
    ckpt = tiny_checkpoint("deepseek_v32", mtp=True)
    own = [
        "--topk-overlap",
        "off",
        "--prefill",
        "model",
        "--concurrency",
        "2",
        "--hot-buffer-rows",
        "96",
    ]
    spec = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    import hisparse.bench.cli as bench_cli

    cells: list[list[list[int]]] = []  # every cell's tokens (the JSON leaves them out)

    def run_cell(*a, **kw):
        row = original(*a, **kw)
        cells.append(row["token_ids"])
        return row

    original = bench_cli.run_cell
    monkeypatch.setattr(bench_cli, "run_cell", run_cell)
    tokens = {}
    for name, extra in (("plain", own), ("spec", own + spec)):
        cells.clear()
        assert main(_bench_argv(ckpt, tmp_path, *extra)) == 0
        out = capsys.readouterr().out
        doc = json.loads((tmp_path / "bench.json").read_text())
        tokens[name] = list(cells)
        assert all(r["same_tokens"] is True for r in doc["ratios"])
    assert len(tokens["spec"]) == 2 and tokens["spec"] == tokens["plain"]
    assert "drafts accepted" in out and "mean accepted length" in out
    for r in doc["results"]:
        assert r["spec_drafted"] > 0 and 0 <= r["spec_accepted"] <= r["spec_drafted"]
        assert r["mean_accepted_length"] >= 1
    assert main(_bench_argv(ckpt, tmp_path, *spec)) == 2
    assert "add --topk-overlap off --prefill model" in capsys.readouterr().err
