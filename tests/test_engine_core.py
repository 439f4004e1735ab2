"""The engine core's seams (docs/design.md §12.0): the scheduler runs without torch and returns
plain data, the default (async) decode step reads top to bottom, and the parallel package
never imports the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hisparse"

_WITHOUT_TORCH = r"""
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError

from hisparse.config import HiSparseConfig
from hisparse.engine.kv_blocks import KVBlockManager
from hisparse.engine.request import Request, Status
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.step_data import ModelOutput
from hisparse.kv.specs import CacheKind, LayerCacheSpec, RowFormat

specs = []
for i in range(2):
    name = f"layers.{i}.attn"
    specs.append(LayerCacheSpec(name, CacheKind.SPARSE, 64, 4, RowFormat.BF16_MLA, name))
    specs.append(LayerCacheSpec(f"layers.{i}.indexer", CacheKind.INDEXER, 32, 4))
cfg = HiSparseConfig(top_k=4, host_pool_gib=0.001, block_size=4, offload="always").resolve()
kv = KVBlockManager(specs, cfg, placement="hisparse", gpu_budget_bytes=2**20,
                    max_model_len=64, max_num_seqs=2)
sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=16)
reqs = [Request(f"r{i}", list(range(1, 10 + 7 * i)), SamplingParams(temperature=0, max_tokens=5))
        for i in range(3)]
for r in reqs:
    sched.add(r)
free0 = kv.gpu_blocks.num_free
steps = updates = 0
while sched.has_work:
    out = sched.schedule()
    updates += len(out.table_updates)
    for part in out.parts:  # no runner: every sampled token is 7
        n = len([r for (r, _), f in zip(part.batch, part.finishing) if f or part.decode])
        sampled = [r for (r, _), f in zip(part.batch, part.finishing) if f or part.decode]
        sched.update_from_output(part, ModelOutput(sampled, [7] * n, [None] * n, 0.0))
    steps += 1
    assert steps < 100
assert all(r.status is Status.FINISHED and r.output_token_ids == [7] * 5 for r in reqs)
assert not kv.requests and kv.gpu_blocks.num_free == free0
assert updates > 0  # the block-table changes travelled as data
assert "torch" not in {m.split(".")[0] for m, mod in sys.modules.items() if mod is not None}
print("ok", steps)
"""


def test_scheduler_runs_a_schedule_update_cycle_without_torch():
    """`engine/scheduler.py` and the KV accounting import no torch and issue no device work:
    with torch blocked, three requests (one waiting for a slot) run from admission to their
    last token through `schedule` / `update_from_output` alone, every block comes back, and
    the table changes come out as `TableUpdate` data."""
    res = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (function-level imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_parallel_never_imports_the_engine():
    """The engine imports `hisparse.parallel`; nothing in `hisparse.parallel` imports the
    engine back (its worker entry points live in `engine/tp_follower.py`)."""
    for path in sorted((SRC / "parallel").glob("*.py")):
        bad = {m for m in _imports(path) if m.startswith("hisparse.engine")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_no_engine_module_over_600_lines():
    for path in sorted((SRC / "engine").glob("*.py")):
        n = len(path.read_text().splitlines())
        assert n <= 600, f"{path.name}: {n} lines"


@pytest.fixture(scope="module")
def tiny_dsa_checkpoint(tmp_path_factory):
    from hisparse.models.tiny import make_tiny

    out = tmp_path_factory.mktemp("deepseek_v32")
    make_tiny("deepseek_v32", out, seed=0)
    return out


#: how deep below `LLM.step` the step's spine is read (hisparse frames only)
SPINE_DEPTH = 4


def _is_property(module: str, qualname: str) -> bool:
    owner, _, name = qualname.rpartition(".")
    cls = getattr(sys.modules.get(module), owner, None) if owner and "." not in owner else None
    return isinstance(getattr(cls, "__dict__", {}).get(name), property)


@pytest.mark.parametrize("placement", ["hisparse", "gpu"])
def test_the_default_decode_step_reads_top_to_bottom(tiny_dsa_checkpoint, placement):
    """One steady-state decode step on the default path (async scheduling, the fixed-shape
    step; the CPU runs it without capture) traced with `sys.setprofile`: the hops of its spine
    — calls from one hisparse module into another within the first `SPINE_DEPTH` levels of
    hisparse calls below `LLM.step`, property reads and comprehensions aside — are at most 15,
    over at most 8 modules."""
    from hisparse import HiSparseConfig, SamplingParams
    from hisparse.engine.llm import LLM

    llm = LLM(tiny_dsa_checkpoint, kv_placement=placement, kv_format="bf16", max_model_len=128,
              max_num_seqs=2, gpu_memory_gib=0.02, cuda_graphs=True,
              hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4))  # fmt: skip
    with llm:
        llm.add_request(list(range(1, 8)), SamplingParams(temperature=0, max_tokens=20))
        for _ in range(6):
            llm.step()
        assert llm._inflight is not None  # a chained decode is in flight: the steady state
        stack: list[str | None] = []
        hops: dict[str, str] = {}
        skip = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "__create_fn__", "<lambda>")

        def profile(frame, event, _arg):
            if event == "call":
                module, q = frame.f_globals.get("__name__", ""), frame.f_code.co_qualname
                ours = module.startswith("hisparse.") and not any(s in q for s in skip)
                ours = ours and not _is_property(module, q)
                caller = next((m for m in reversed(stack) if m is not None), None)
                depth = sum(m is not None for m in stack) + 1
                if ours and caller is not None and caller != module and depth <= SPINE_DEPTH:
                    hops.setdefault(f"{module}:{q}", caller)
                stack.append(module if ours else None)
            elif event == "return" and stack:
                stack.pop()

        sys.setprofile(profile)
        try:
            llm.step()
        finally:
            sys.setprofile(None)
    modules = {h.split(":")[0] for h in hops} | {"hisparse.engine.llm"}
    listing = "\n".join(f"{caller} -> {h}" for h, caller in hops.items())
    assert "hisparse.engine.scheduler:Scheduler.continue_decode" in hops, listing
    assert len(hops) <= 15, listing
    assert len(modules) <= 8, listing
