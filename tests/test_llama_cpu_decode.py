"""The CPU batch-1 decode path of `LlamaForCausalLM` (`_decode_one_cpu`) against the general
layer loop, on a small random model: without numba (torch/numpy only) it is the general loop
bit for bit; with numba the attention sums in another order (close, same tokens). Dense and
sparse budgets; the fused projection weights follow a reload of the parameters."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.gqa_indexer_reference import GqaIndexerConfig
from hisparse.models.llama import LlamaConfig, LlamaForCausalLM
from hisparse.runtime.ops import cpu_backend

CONFIG = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
)  # fmt: skip
PROMPT = 45
STEPS = 6


def _model(top_k: int | None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG, GqaIndexerConfig(top_k=top_k, recent_window=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _decode(model: LlamaForCausalLM, fast: bool, jit: bool) -> tuple[torch.Tensor, list[int]]:
    """Logits of a prompt's last token and of ``STEPS`` greedy decode steps."""
    backend = cpu_backend()
    saved_fast = backend.fast_decode
    backend.fast_decode = fast
    backend.jit_enabled = jit
    try:
        cache = model.new_dense_cache(max_reqs=1, max_len=PROMPT + STEPS + 1, block_size=8)
        feed = torch.randint(
            0, CONFIG.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)
        )
        logits, tokens = [], []
        with torch.no_grad():
            for _ in range(STEPS + 1):
                step = cache.begin_step([0], [feed.shape[0]])
                out = model.logits(model(feed, step, cache))[-1]
                logits.append(out)
                tokens.append(int(out.argmax()))
                feed = torch.tensor(tokens[-1:])
        return torch.stack(logits), tokens
    finally:
        backend.fast_decode = saved_fast
        backend.jit_enabled = True


@pytest.mark.parametrize("top_k", [None, 24], ids=["dense", "sparse"])
def test_fast_decode_equals_the_general_loop(top_k: int | None) -> None:
    model = _model(top_k)
    want, want_tokens = _decode(model, fast=False, jit=False)
    got, tokens = _decode(model, fast=True, jit=False)
    assert torch.equal(got, want)
    if cpu_backend().jit() is None:
        pytest.skip("numba is not installed (or HISPARSE_CPU_JIT=0)")
    got, tokens = _decode(model, fast=True, jit=True)
    assert tokens == want_tokens
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_fused_weights_are_views_and_follow_a_reload() -> None:
    model = _model(24)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want, _ = _decode(model, fast=False, jit=False)
    _decode(model, fast=True, jit=False)
    attn = model.model.layers[0].self_attn
    fused = attn._qkv[0]
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # A round trip through bf16 replaces every weight's memory: fused again, still equal.
    model.to(torch.bfloat16).to(torch.float32)
    want, _ = _decode(model, fast=False, jit=False)
    got, _ = _decode(model, fast=True, jit=False)
    assert torch.equal(got, want)
    assert attn._qkv[0].data_ptr() != fused.data_ptr()
