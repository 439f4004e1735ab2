"""The per-rank streaming loader and the vocabulary-parallel head (tensor parallelism, CPU):
each rank's shard is exactly its slice of the checkpoint (scale tiles included); tp 2 gives
tp 1's greedy tokens on an fp8 checkpoint; and a rank's peak anonymous memory while it loads a
~340 MB fp8 checkpoint stays within the weights it keeps plus the checkpoint's largest tensor
plus 64 MiB (``RssAnon``, sampled: memory-mapped checkpoint pages count in RSS, not there)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams
from hisparse.models import fp8
from hisparse.models.checkpoint import CheckpointIndex
from hisparse.models.checkpoint_writer import write_checkpoint
from hisparse.models.loader import load_dsa_model
from hisparse.models.tiny import make_tiny
from hisparse.models.vocab_parallel import VocabParallelEmbedding, VocabParallelHead

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _short_collective_timeout(monkeypatch):
    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "60")  # a hang fails in 60 s


@pytest.fixture(scope="module")
def v32_fp8(tmp_path_factory):
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("v32-fp8"), fp8=True)


def test_rank_shards_are_the_checkpoint_slices(v32_fp8) -> None:
    """Two ranks' parameters put side by side are the one-rank model's: heads, MLP and expert
    widths, scale tiles, the vocabulary (padded to equal halves), the MTP layer."""
    one = dict(load_dsa_model(v32_fp8, dtype=torch.float32).named_parameters())
    ranks = [dict(load_dsa_model(v32_fp8, dtype=torch.float32, rank=r, world=2)
                  .named_parameters()) for r in (0, 1)]  # fmt: skip
    assert one.keys() == ranks[0].keys() == ranks[1].keys()
    for name, whole in one.items():
        parts = [r[name] for r in ranks]
        if all(p.shape == whole.shape for p in parts):
            for p in parts:  # replicated
                assert torch.equal(p.view(torch.uint8) if p.dtype == fp8.FP8_DTYPE else p,
                                   whole.view(torch.uint8) if p.dtype == fp8.FP8_DTYPE
                                   else whole), name  # fmt: skip
            continue
        dim = next(d for d in range(whole.dim()) if parts[0].shape[d] != whole.shape[d])
        if name.endswith(("scale_inv", "_scale")):  # the tiles each slice touches
            assert all(p.shape[dim] <= whole.shape[dim] for p in parts), name
            continue
        joined = torch.cat([p.float() for p in parts], dim=dim)
        assert torch.equal(joined.narrow(dim, 0, whole.shape[dim]), whole.float()), name
        assert (
            joined.narrow(dim, whole.shape[dim], joined.shape[dim] - whole.shape[dim]) == 0
        ).all()
    head = load_dsa_model(v32_fp8, dtype=torch.float32, rank=1, world=2)
    assert isinstance(head.lm_head, VocabParallelHead)
    assert isinstance(head.model.embed_tokens, VocabParallelEmbedding)
    assert head.model.layers[0].self_attn.n_heads == 2
    assert head.model.layers[1].self_attn.q_b_proj.row_offset == 96  # 2 heads x 48 rows


def test_tp2_equals_tp1_on_fp8_weights(v32_fp8) -> None:
    """The per-rank loader and the vocabulary-parallel embedding and head: tp 2 gives tp 1's
    greedy tokens (row-parallel inputs of whole 128-column tiles: the same activation groups)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (33, 20)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    runs = []
    for tp in (1, 2):
        with LLM(v32_fp8, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
                 kv_format="bf16", max_model_len=128, max_num_seqs=2, gpu_memory_gib=0.02,
                 tensor_parallel_size=tp) as llm:  # fmt: skip
            runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=greedy))
    one, two = runs
    assert all(o.ok for o in two), [o.error for o in two]
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


# --- peak anonymous memory while loading -----------------------------------------------------

#: ~340 MB of fp8 weights: 2 MoE layers and the MTP layer of 64 experts (1024 x 512)
_BIG = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8,
    num_key_value_heads=8, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32,
    qk_nope_head_dim=64, v_head_dim=64, index_topk=64, index_head_dim=64, index_n_heads=4,
    max_position_embeddings=4096,
)  # fmt: skip


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _load_and_measure(path: str, rank: int, world: int, out: mp.Queue) -> None:
    """A rank's load, with its RssAnon sampled every millisecond and after every tensor."""
    torch.set_num_threads(1)
    from hisparse.models import loader

    base = _rss_anon()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        peak[0] = max(peak[0], _rss_anon())

    def poll() -> None:
        while not done.is_set():
            sample()
            time.sleep(0.001)

    fill = loader._fill

    def sampled_fill(*args, **kwargs):
        fill(*args, **kwargs)
        sample()

    loader._fill = sampled_fill
    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    model = loader.load_dsa_model(path, dtype=torch.bfloat16, rank=rank, world=world)
    sample()
    done.set()
    watcher.join()
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    out.put((rank, peak[0] - base, kept))


def test_per_rank_loader_peak_anonymous_memory(tmp_path) -> None:
    path = write_checkpoint("deepseek_v32", tmp_path / "big", _BIG, random_bytes=True,
                            shard_bytes=96 * MIB)  # fmt: skip
    index = CheckpointIndex(path)
    whole = index.total_bytes()
    largest = index.largest_tensor_bytes()
    assert whole >= 300e6 and len(index.files) > 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_and_measure, args=(str(path), r, 2, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, peak, kept in sorted(results):
        bound = kept + largest + 64 * MIB
        assert peak <= bound, (rank, peak / MIB, kept / MIB, largest / MIB)
        # a loader that held the whole checkpoint in anonymous memory would not fit the bound
        assert whole > bound
        assert kept < 0.6 * whole  # this rank's half of the experts, the rest whole


def test_vocab_parallel_parts_add_up_to_the_whole() -> None:
    """A vocabulary that does not divide (10 rows over 4 ranks: 3, 3, 3, 1 + 2 zero rows):
    the ranks' embedding outputs add up to the lookup bit for bit (one rank holds each row),
    their logits side by side are the whole LM head's."""
    from hisparse.models.vocab_parallel import vocab_rows

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 6, generator=g)
    ids = torch.tensor([0, 9, 3, 5, 5, 2])
    hidden = torch.randn(4, 6, generator=g)
    looked, logits = [], []
    for rank in range(4):
        first, rows, real = vocab_rows(10, rank, 4)
        emb = VocabParallelEmbedding(10, 6, rank, 4)
        head = VocabParallelHead(10, 6, rank, 4)
        part = torch.zeros(rows, 6)
        part[:real] = weight[first : first + real]
        emb.weight.data, head.weight.data = part, part
        looked.append(emb(ids))
        logits.append(head(hidden))
    assert torch.equal(sum(looked[1:], looked[0]), weight[ids])
    whole = torch.cat(logits, dim=-1)[:, :10]
    torch.testing.assert_close(whole, hidden @ weight.t(), rtol=0, atol=1e-6)
