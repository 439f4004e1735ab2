"""DeepSeek-V4 under HiSparse placement (docs/design.md §20.2), on the CPU: the compressed
sparse layers' entries live in the host pool and are read through each request's hot buffer;
greedy tokens equal the all-GPU placement's and transformers' ``generate`` with prompts whose
entries far exceed the hot buffer, chunked prefill beside decodes, both offload policies, the
lazy host mirror, the fixed-shape decode step and preemption (where `hisparse simulate`
predicts the same admission, demotions and preemptions); every block is back in both pools
after."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hisparse import LLM, HiSparseConfig, SamplingParams  # noqa: E402
from hisparse.models.v4_config import CSA  # noqa: E402
from hisparse.sim.simulator import SimSettings, simulate  # noqa: E402
from hisparse.sim.trace import TraceRequest  # noqa: E402

#: 70 tokens: 17 CSA entries a layer against a hot buffer of 8 rows (top-k 3, pages of 8)
LENGTHS = (70, 37, 9)
NEW = 10
BLOCK = 8


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v4")


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


def _reference(ckpt, prompts, new):
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                min_new_tokens=new)  # fmt: skip
        out.append(want[0, len(prompt) :].tolist())
    return out


def _generate(ckpt, placement, prompts, new, *, blocks=None, **kw):
    """Greedy tokens and outputs of one engine; ``blocks(layout)``: a GPU pool of that many
    blocks (beside the staging area). Checks every block is back in both pools after."""
    hs = HiSparseConfig(block_size=BLOCK, **kw.pop("hs", {}))
    args = dict(kv_placement=placement, device="cpu", max_num_seqs=4, max_model_len=128,
                max_num_batched_tokens=16, hisparse=hs, **kw)  # fmt: skip
    gib = 0.02
    if blocks is not None:
        with LLM(ckpt, gpu_memory_gib=gib, **args) as probe:
            lay = probe.kv.layout
            gib = (blocks(lay) * lay.gpu_bytes_per_block + lay.staging_bytes) / 2**30
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    with LLM(ckpt, gpu_memory_gib=gib, **args) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        kv = llm.kv
        assert not kv.requests and kv.gpu_blocks.num_free == kv.gpu_blocks.num_usable
        assert kv.host_blocks is None or kv.host_blocks.num_free == kv.host_blocks.num_usable
        running = max((st["running"] for st in llm.step_stats if st["decode"]), default=0)
        seen = dict(demotions=llm.scheduler.demotions, gib=gib, running=running)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs], outs, seen


@pytest.fixture(scope="module")
def want(ckpt):
    prompts = _prompts(LENGTHS, 5)
    gpu, _, _ = _generate(ckpt, "gpu", prompts, NEW)
    assert gpu == _reference(ckpt, prompts, NEW)
    return prompts, gpu


@pytest.mark.parametrize(
    "kw",
    [
        dict(hs=dict(offload="always")),
        dict(hs=dict(offload="under_pressure")),
        dict(hs=dict(offload="always", eager_host_mirror=False)),
        dict(hs=dict(offload="always"), cuda_graphs=True),
    ],
    ids=["always", "under_pressure", "lazy-mirror", "fixed-shape"],
)
def test_hisparse_equals_all_gpu_and_transformers(ckpt, want, kw):
    prompts, gpu = want
    tokens, outs, _ = _generate(ckpt, "hisparse", prompts, NEW, **kw)
    assert tokens == gpu
    if kw["hs"]["offload"] == "always":
        # the entries came through the hot buffers: misses swapped in, hits served
        assert sum(o.metrics.misses for o in outs) > 0 and sum(o.metrics.hits for o in outs) > 0


def test_triton_kernel_over_the_step_buffer(ckpt, monkeypatch):
    """The attention kernel CUDA runs (here under the interpreter) over the step buffer of
    window rows and entries gathered through the hot buffer: transformers' tokens."""
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    prompts = _prompts((30,), 6)
    tokens, outs, _ = _generate(ckpt, "hisparse", prompts, 4, hs=dict(offload="always"))
    assert sum(o.metrics.misses for o in outs) > 0
    assert tokens == _reference(ckpt, prompts, 4)


def test_preemption_under_hisparse(ckpt):
    """A GPU pool of 1.5 requests at their peak: decodes outgrow it, the newest request is
    preempted and recomputed (its entries mirrored again, its hot buffer reset); tokens equal
    the all-GPU run's and transformers'. Under ``under_pressure`` demotions come first."""
    prompts = _prompts((20, 23, 30, 33), 9)
    new = 40
    gpu, _, _ = _generate(ckpt, "gpu", prompts, new)
    assert gpu == _reference(ckpt, prompts, new)
    pool = lambda lay: 1 + int(1.5 * lay.gpu_blocks_per_request(lay.max_model_len))  # noqa: E731
    for offload in ("always", "under_pressure"):
        tokens, outs, seen = _generate(ckpt, "hisparse", prompts, new, blocks=pool,
                                       hs=dict(offload=offload))  # fmt: skip
        preemptions = sum(o.metrics.preemptions for o in outs)
        assert preemptions > 0, offload
        assert (seen["demotions"] > 0) == (offload == "under_pressure")
        assert sum(o.metrics.misses for o in outs) > 0, offload  # demoted rows from the host
        assert tokens == gpu, offload
        # `hisparse simulate` runs the same admission, demotion and preemption (its own
        # accounting of the same V4 specs; its top-k is replayed, so hits and misses differ)
        sim = simulate(
            SimSettings(model=str(ckpt), gpu_memory_gib=seen["gib"], max_model_len=128,
                        max_num_seqs=4, max_num_batched_tokens=16, block_size=BLOCK,
                        target="cpu", offload=offload),
            [TraceRequest(0.0, len(p), new) for p in prompts],
        )  # fmt: skip
        assert (sim["preemptions"], sim["peak_running"]) == (preemptions, seen["running"])


def test_generate_cli(ckpt, capsys):
    """`hisparse generate --kv-placement hisparse --offload always`: the entries come through
    the hot buffer (the summary's hit rate)."""
    from hisparse.cli import main

    prompt = "The quick brown fox jumps over the lazy dog, again and again and again."
    argv = ["generate", "--model", str(ckpt), "--prompt", prompt, "--max-tokens", "6",
            "--kv-placement", "hisparse", "--offload", "always", "--device", "cpu",
            "--max-model-len", "128"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "6 tokens" in out and "hit rate" in out


def test_where_the_rows_live(ckpt):
    """HiSparse specs: one sparse cache per compressed sparse layer, a head_dim row (its
    entries, the only rows on the host); the HCA entries and the CSA indexer's in
    GPU-resident caches, each spread over its window's token rows (``width / rate`` values a
    row); every layer's window a ring of ``sliding_window`` rows per slot."""
    with LLM(ckpt, kv_placement="hisparse", device="cpu", max_model_len=64, max_num_seqs=2,
             hisparse=HiSparseConfig(block_size=BLOCK)) as llm:  # fmt: skip
        cfg = llm.model.config
        sparse = [h.runtime.name for h in llm.runner.handles]
        assert sparse == [f"layers.{i}.attn" for i, t in enumerate(cfg.layer_types) if t == CSA]
        assert all(h.runtime.row_bytes == cfg.head_dim * 4 for h in llm.runner.handles)
        lay = llm.kv.layout
        assert set(lay.host_views) == set(sparse)
        resident = {n for n in lay.gpu_views if n.endswith(".indexer")}
        compressed = [i for i in range(cfg.num_hidden_layers) if cfg.compress_rate(i)]
        assert resident == {f"layers.{i}.indexer" for i in compressed}
        for i in compressed:
            width = cfg.index_head_dim if cfg.layer_types[i] == CSA else cfg.head_dim
            assert (
                lay.gpu_views[f"layers.{i}.indexer"].row_bytes == width // cfg.compress_rate(i) * 4
            )
        for i in range(cfg.num_hidden_layers):  # 2 slots and the spare
            ring = llm.runner.v4_state.stores[(i, "state.window")]
            assert ring.shape == (3, cfg.sliding_window, cfg.head_dim)
