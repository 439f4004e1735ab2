"""The greedy sampler's Triton argmax on the GPU against ``torch.argmax(logits.float())``,
at the engine's batch sizes and at DeepSeek-V3.2's vocabulary (several chunks a row)."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.sampling_triton import argmax_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 129280), (29, 129280), (256, 129280), (29, 4096),
                                        (64, 49152), (3, 16385)])  # fmt: skip
def test_argmax_rows_equals_torch_on_cuda(dtype, rows, vocab) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    x = torch.randn((rows, vocab), generator=g, device="cuda").to(dtype)
    top = x.float().max().item() + 1
    if rows > 4:  # a tie across chunks, NaN, nothing finite, signed zeros
        x[1, [vocab - 1, vocab // 2]] = top
        x[2, vocab - 3] = float("nan")
        x[3].fill_(float("-inf"))
        x[4].fill_(-1.0)
        x[4, vocab - 1] = 0.0
        x[4, 7] = -0.0
    got = argmax_rows(x)
    want = torch.argmax(x.float(), dim=-1)
    assert torch.equal(got, want), (got - want).nonzero()
