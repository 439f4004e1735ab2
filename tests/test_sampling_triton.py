"""The greedy sampler's Triton argmax (`hisparse.engine.sampling_triton`, CPU interpreter)
against ``torch.argmax(logits.float(), -1)``: ties, NaN of either sign, signed zeros,
infinities, rows of one chunk and of several, bf16 / fp16 / fp32 logits; and the sampler
taking it on its greedy rows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from hisparse.attention.sparse_mla_triton import interpreting
from hisparse.engine import sampling_triton
from hisparse.engine.sampling import greedy_tokens
from hisparse.engine.sampling_triton import BLOCK, argmax_rows, chunks_for

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels were defined outside the interpreter"
)


def _rows(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with the cases an argmax can get wrong planted in some rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, vocab), generator=g).to(dtype)
    top = x.float().max().item() + 1
    last = vocab - 1
    cases = [
        lambda r: r.__setitem__([3, last], top),  # a tie: the first index wins
        lambda r: (r.__setitem__(5, float("nan")), r.__setitem__(last, float("nan"))),
        lambda r: r.__setitem__(7, -float("nan")),  # NaN of either sign is the largest
        lambda r: r.fill_(float("-inf")),  # nothing finite: the first index
        lambda r: (r.fill_(-1.0), r.__setitem__(last, 0.0), r.__setitem__(2, -0.0)),
        lambda r: (r.__setitem__(last, float("inf")), r.__setitem__(1, float("inf"))),
        lambda r: r.fill_(0.5),  # all equal
    ]
    for i, case in enumerate(cases[: rows - 1]):
        case(x[i + 1])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab,chunks", [(9, 300, 1), (9, 5 * BLOCK + 17, 3),
                                               (2, 2 * BLOCK, 2), (1, 70, None)])  # fmt: skip
def test_argmax_rows_equals_torch(dtype, rows, vocab, chunks) -> None:
    x = _rows(rows, vocab, dtype, seed=rows * vocab)
    got = argmax_rows(x, chunks)
    want = torch.argmax(x.float(), dim=-1)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)


def test_strided_rows_and_default_chunks(monkeypatch) -> None:
    """Row-strided logits (a view of a wider buffer) and a vocabulary past one chunk, with
    the chunk length lowered so the interpreter runs it at a small size."""
    monkeypatch.setattr(sampling_triton, "MAX_CHUNK", BLOCK)
    vocab = 3 * BLOCK + 5
    assert chunks_for(4, vocab, sms=4) >= 4
    wide = _rows(4, vocab + 9, torch.float32, seed=3)
    x = wide[:, :vocab]
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


def test_greedy_tokens_takes_the_kernel_where_asked(monkeypatch) -> None:
    x = _rows(6, 500, torch.bfloat16, seed=7)
    calls = []
    real = sampling_triton.argmax_rows
    monkeypatch.setattr(sampling_triton, "argmax_rows", lambda t: calls.append(t) or real(t))
    assert torch.equal(greedy_tokens(x), torch.argmax(x.float(), dim=-1)) and not calls
    monkeypatch.setenv("HISPARSE_FUSED", "triton")
    assert torch.equal(greedy_tokens(x), torch.argmax(x.float(), dim=-1)) and calls
