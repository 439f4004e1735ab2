"""The index-group leader's one-read group gather gives the same GPU bytes as per-layer gathers.

A group of G layers with the token-major host layout (docs/design.md §4.1) and device views that are
pages of one pool: decode swap-ins through `IndexGroupRuntime.resolve_and_gather` must leave exactly
the bytes (and hot state) the per-layer `gather_compact` path leaves, on the CPU reference
ops and on the Triton kernels in the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hisparse.config import HiSparseConfig
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.sparse_layer import SparseLayerRuntime

BS, W, K, H = 4, 32, 8, 16


def _i32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int32)


class World:
    """G layers in one index group over one token-major host tensor and one device pool."""

    def __init__(self, G: int, Q: int, nb: int, seed: int, *, layer_order: list[int]) -> None:
        g = torch.Generator().manual_seed(seed)
        cfg = HiSparseConfig(
            top_k=K, block_size=BS, device_buffer_size=H, max_query_len=1, host_pool_gib=0.001
        ).resolve()
        self.G, self.Q, self.nb = G, Q, nb
        nh = 1 + Q * nb
        hb = cfg.hot_blocks_per_request
        nd = 1 + Q * hb + Q * nb
        self.host = torch.randint(0, 256, (nh, BS, G, W), dtype=torch.uint8, generator=g)
        # Device pool: block-outermost, each layer's page at its own in-block offset.
        self.pool = torch.randint(0, 256, (nd, G, BS, W), dtype=torch.uint8, generator=g)
        self.layers: list[SparseLayerRuntime] = []
        for li in range(G):
            rt = SparseLayerRuntime(
                f"l{li}", cfg, row_bytes=W, max_num_reqs=Q, device="cpu",
                index_group=self.layers[0].group if self.layers else None,
            )  # fmt: skip
            # Layer li of the group sits at span slot layer_order[li] (any order is allowed).
            rt.bind_host(self.host[:, :, layer_order[li]])
            rt.bind_device(self.pool[:, layer_order[li]])
            self.layers.append(rt)
        self.group = self.layers[0].group
        hot_bt = 1 + torch.randperm(Q * hb, generator=g).view(Q, hb)
        self.group.bind_hot_block_table(_i32(hot_bt))
        self.src_bt = _i32(1 + torch.randperm(Q * nb, generator=g).view(Q, nb))
        # A few pages resident (their rows never need the hot buffer).
        res = torch.rand(Q, nb, generator=g) < 0.2
        res_ids = 1 + Q * hb + torch.randperm(Q * nb, generator=g).view(Q, nb)
        self.res_bt = _i32(torch.where(res, res_ids, 0))

    def step(self, topk: torch.Tensor) -> torch.Tensor:
        Q = self.Q
        meta = StepMetadata(
            num_tokens=Q,
            is_decode=True,
            req_per_token=_i32(list(range(Q))),
            request_state_indices=_i32(list(range(Q))),
            source_block_table=self.src_bt,
            host_slot_mapping=None,
        )
        tables = GroupTables(
            resident_block_table=self.res_bt, slot_mapping=torch.full((Q,), -1, dtype=torch.int32)
        )
        self.group.resolve_and_gather(meta, tables, topk)
        for rt in self.layers:
            rt.wait_ready()
        return self.group.physical[:Q, :K].clone()


def _topks(Q: int, nb: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out, prev = [], None
    for _ in range(steps):
        t = torch.stack([torch.randperm(nb * BS, generator=g)[:K] for _ in range(Q)])
        if prev is not None:  # decode drift: keep about half of last step's picks
            keep = torch.rand(Q, K, generator=g) < 0.5
            t = torch.where(keep, prev, t)
        t = torch.where(torch.rand(Q, K, generator=g) < 0.1, -1, t)
        prev = t
        out.append(t.to(torch.int32))
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "G,order",
    [
        (2, [0, 1]),  # leader first in the span
        (3, [0, 1, 2]),
        (3, [2, 0, 1]),  # leader last
        (3, [1, 0, 2]),  # leader in the middle
    ],
)
def test_group_gather_equals_per_layer(
    backend: str, G: int, order: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        from hisparse.runtime.ops.triton_common import interpreting

        if not interpreting():
            pytest.skip("Triton kernels were defined outside the interpreter")
    monkeypatch.setenv("HISPARSE_OPS", backend)
    Q, nb, seed = 3, 6, 10 * G + order[0]
    a = World(G, Q, nb, seed, layer_order=order)  # group gather
    b = World(G, Q, nb, seed, layer_order=order)  # forced per-layer gathers
    assert a.group.span_gather_views() is not None
    assert getattr(a.group.ops, "__name__", "").endswith(
        "triton_backend" if backend == "triton" else "reference"
    )
    b.group._span_checked, b.group._span_gather = True, None
    calls = {"group": 0}
    orig = a.group.ops.gather_compact_group

    def counting(*args, **kw) -> None:  # type: ignore[no-untyped-def]
        calls["group"] += 1
        orig(*args, **kw)

    monkeypatch.setattr(a.group, "ops", _Proxy(a.group.ops, gather_compact_group=counting))
    assert torch.equal(a.pool, b.pool)
    before = a.pool.clone()
    for step, topk in enumerate(_topks(Q, nb, 3, seed)):
        pa, pb = a.step(topk), b.step(topk)
        assert torch.equal(pa, pb), step
        assert torch.equal(a.group.hot_index, b.group.hot_index)
        assert torch.equal(a.pool, b.pool), f"step {step}: device bytes differ"
    assert calls["group"] == 3
    assert not torch.equal(a.pool, before)  # something was swapped in
    # Every non-resident selected row now holds its host row, in every layer.
    rows = a.group.physical[:Q, :K]
    topk = _topks(Q, nb, 3, seed)[-1]
    for q in range(Q):
        for i in range(K):
            p = int(topk[q, i])
            if p < 0:
                continue
            hrow = int(a.src_bt[q, p // BS]) * BS + p % BS
            r = int(rows[q, i])
            if int(a.res_bt[q, p // BS]):
                continue
            for li in range(G):
                dev = a.layers[li].device_view
                host = a.layers[li].host_view
                assert dev is not None and host is not None
                assert torch.equal(dev[r // BS, r % BS], host[hrow // BS, hrow % BS])


class _Proxy:
    """An op namespace with some ops replaced (to count calls)."""

    def __init__(self, inner: object, **over: object) -> None:
        self._inner, self._over = inner, over

    def __getattr__(self, name: str) -> object:
        return self._over[name] if name in self._over else getattr(self._inner, name)


def test_group_gather_not_used_when_layout_does_not_allow_it() -> None:
    """Layer-major host views, or device views in separate tensors: per-layer gathers."""
    cfg = HiSparseConfig(
        top_k=K, block_size=BS, device_buffer_size=H, max_query_len=1, host_pool_gib=0.001
    ).resolve()

    def build(host_token_major: bool, shared_device: bool):
        host = torch.zeros((5, BS, 2, W), dtype=torch.uint8)
        pool = torch.zeros((9, 2, BS, W), dtype=torch.uint8)
        own_host = torch.zeros((5, BS, W), dtype=torch.uint8)
        own_dev = torch.zeros((9, BS, W), dtype=torch.uint8)
        layers: list[SparseLayerRuntime] = []
        for li in range(2):
            rt = SparseLayerRuntime(
                f"l{li}", cfg, row_bytes=W, max_num_reqs=1, device="cpu",
                index_group=layers[0].group if layers else None,
            )  # fmt: skip
            rt.bind_host(host[:, :, li] if host_token_major else own_host.clone())
            rt.bind_device(pool[:, li] if shared_device else own_dev.clone())
            layers.append(rt)
        return layers[0].group

    assert build(True, True).span_gather_views() is not None
    assert build(False, True).span_gather_views() is None
    assert build(True, False).span_gather_views() is None
    # A group of one never uses it.
    one = SparseLayerRuntime("solo", cfg, row_bytes=W, max_num_reqs=1, device="cpu")
    one.bind_host(torch.zeros((5, BS, W), dtype=torch.uint8))
    one.bind_device(torch.zeros((9, BS, W), dtype=torch.uint8))
    assert one.group.span_gather_views() is None
    # Rebinding re-checks.
    grp = build(True, True)
    grp.layers[1].bind_host(torch.zeros((5, BS, W), dtype=torch.uint8))
    assert grp.span_gather_views() is None
