"""Property test: the real runtime against an independent plain-Python model of the cache.

A hypothesis state machine drives `SparseLayerRuntime` + `IndexGroupRuntime` + `CacheHandle` (CPU
tensors) through long random request lifecycles: requests start (slot reset,
prompt written directly + `invalidate_written` or through `finish_kv_update`, optional warm
start), decode with 1..max_query_len rows each (speculative rows, some rejected and rewritten
in the next step), spill and reload resident pages, rewrite host rows (recompute), and
finish (host blocks freed and handed to later requests, LIFO, so reuse is quick).

The model (`hisparse.testing.cache_model`) knows nothing of the runtime's code. After every
step the outputs (physical rows, valid counts, swap lists, hit/miss counts), the hot state of
every slot, the running totals and every byte of every layer's memory are compared, and the
§5 invariants are checked. The machine runs twice, on the reference ops (the oracle) and on
the CPU backend (what the runtime uses for CPU tensors), each against the same model.
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hisparse.config import HiSparseConfig, cdiv
from hisparse.runtime.batch import GroupTables, StepMetadata
from hisparse.runtime.cache_handle import CacheHandle
from hisparse.runtime.ops import cpu_backend, ops_for, reference
from hisparse.runtime.sparse_layer import SparseLayerRuntime
from hisparse.testing.cache_model import (
    HotModel,
    Memory,
    Req,
    Resolved,
    int32s,
    row_bytes,
    set_row,
    view_bytes,
)

# ------------------------------------------------------------------------------------------
# Helpers (the model: `hisparse.testing.cache_model`)
# ------------------------------------------------------------------------------------------


@st.composite
def runtime_configs(draw: st.DrawFn) -> dict[str, int]:
    bs = draw(st.sampled_from([2, 4]))
    top_k = draw(st.integers(1, 5))
    mql = draw(st.integers(1, 3))
    extra = draw(st.sampled_from([0, 0, 1, bs, top_k + 1]))
    return dict(
        bs=bs,
        top_k=top_k,
        mql=mql,
        hot=mql * top_k + extra,
        layers=draw(st.integers(1, 3)),
        max_reqs=draw(st.integers(1, 4)),
        pages=draw(st.integers(2, 8)),
        row_bytes=draw(st.sampled_from([16, 32])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ------------------------------------------------------------------------------------------
# The state machine
# ------------------------------------------------------------------------------------------


class RuntimeMachine(RuleBasedStateMachine):
    """Runtime under random request lifecycles, checked against `HotModel` + `Memory`."""

    #: The data-plane ops the runtime calls (every op goes through ``IndexGroupRuntime.ops``).
    OPS: object = reference

    def __init__(self) -> None:
        super().__init__()
        self.ready = False

    # --- setup -------------------------------------------------------------------------
    @initialize(cfg=runtime_configs())
    def setup(self, cfg: dict[str, int]) -> None:
        rng = random.Random(cfg["seed"])
        self.bs, self.K, self.mql = cfg["bs"], cfg["top_k"], cfg["mql"]
        self.H, self.S, self.NB, self.W = (
            cfg["hot"],
            cfg["max_reqs"],
            cfg["pages"],
            cfg["row_bytes"],
        )
        self.L = cfg["layers"]
        self.config = HiSparseConfig(
            top_k=self.K,
            block_size=self.bs,
            device_buffer_size=self.H,
            max_query_len=self.mql,
            host_pool_gib=0.001,
        ).resolve()
        hb = cdiv(self.H, self.bs)
        # Host pool: null block + enough for S full requests. Device pool: null block, S hot
        # regions, and one resident block per possible page (never exhausted).
        self.num_host_blocks = 1 + self.S * self.NB + 1
        num_dev_blocks = 1 + self.S * hb + self.S * self.NB
        dev_ids = list(range(1, num_dev_blocks))
        rng.shuffle(dev_ids)
        hot_ids, self.free_dev = dev_ids[: self.S * hb], dev_ids[self.S * hb :]
        hot_bt = [hot_ids[s * hb : (s + 1) * hb] for s in range(self.S)]
        self.free_host = list(range(self.num_host_blocks - 1, 0, -1))  # pop() -> 1, 2, ...
        self.refcount = [0] * self.num_host_blocks

        self.layers: list[SparseLayerRuntime] = []
        self.handles: list[CacheHandle] = []
        self.host_views: list[torch.Tensor] = []
        self.dev_views: list[torch.Tensor] = []
        self.mem: list[Memory] = []
        # Token-major host rows within the group and a block-outermost device pool (docs/design.md
        # §4): every layer's view is a strided slice of one tensor.
        nh, nd, bs, W, L = self.num_host_blocks, num_dev_blocks, self.bs, self.W, self.L
        host_all = torch.frombuffer(bytearray(rng.randbytes(nh * bs * L * W)), dtype=torch.uint8)
        dev_all = torch.frombuffer(bytearray(rng.randbytes(nd * L * bs * W)), dtype=torch.uint8)
        host_all, dev_all = host_all.reshape(nh, bs, L, W), dev_all.reshape(nd, L, bs, W)
        for li in range(L):
            rt = SparseLayerRuntime(
                f"layer{li}",
                self.config,
                row_bytes=W,
                max_num_reqs=self.S,
                device="cpu",
                index_group=self.layers[0].group if self.layers else None,
            )
            host, dev = host_all[:, :, li], dev_all[:, li]
            rt.bind_host(host)
            rt.bind_device(dev)
            self.layers.append(rt)
            self.handles.append(CacheHandle(rt))
            self.host_views.append(host)
            self.dev_views.append(dev)
            self.mem.append(Memory(view_bytes(host), view_bytes(dev), W))
        CacheHandle.link_index_group(self.handles)
        self.group = self.layers[0].group
        assert self.group.ops is ops_for("cpu")
        self.group.ops = self.OPS
        self.group.bind_hot_block_table(int32s(hot_bt))
        self.model = HotModel(self.S, self.H, self.bs, hot_bt)
        self.gen: dict[int, int] = {}  # host row -> write generation
        self.reqs: dict[int, Req] = {}  # slot -> live request
        self.ready = True

    # --- scenario helpers ----------------------------------------------------------------
    def _host_row(self, req: Req, pos: int) -> int:
        return req.blocks[pos // self.bs] * self.bs + pos % self.bs

    def _own_block(self, req: Req, page: int) -> bool:
        return self.refcount[req.blocks[page]] == 1

    def _make_resident(self, req: Req, page: int) -> None:
        """Give ``page`` a GPU page holding the host content (a reload; test-level copy)."""
        if req.resident[page]:
            return
        blk = self.free_dev.pop()
        req.resident[page] = blk
        for li, m in enumerate(self.mem):
            for off in range(self.bs):
                data = m.get(m.host, req.blocks[page] * self.bs + off)
                m.put(m.dev, blk * self.bs + off, data)
                set_row(self.dev_views[li], blk * self.bs + off, data)

    def _ensure_pages(self, req: Req, end: int) -> None:
        """Allocate host blocks (not resident) up to position ``end`` (exclusive)."""
        while len(req.blocks) < cdiv(end, self.bs):
            blk = self.free_host.pop()
            self.refcount[blk] += 1
            req.blocks.append(blk)
            req.resident.append(0)

    def _new_content(self, rng: random.Random) -> list[bytes]:
        return [rng.randbytes(self.W) for _ in range(self.L)]

    def _bump(self, g: int) -> None:
        self.gen[g] = self.gen.get(g, 0) + 1

    def _write_direct(self, req: Req, positions: list[int], rng: random.Random) -> list[int]:
        """Write new rows straight into the host (and the resident copy); returns host rows."""
        rows = []
        for p in positions:
            g = self._host_row(req, p)
            rows.append(g)
            self._bump(g)
            res = req.resident[p // self.bs]
            for li, data in enumerate(self._new_content(rng)):
                m = self.mem[li]
                m.put(m.host, g, data)
                set_row(self.host_views[li], g, data)
                if res:
                    r = res * self.bs + p % self.bs
                    m.put(m.dev, r, data)
                    set_row(self.dev_views[li], r, data)
        return rows

    def _invalidate_meta(
        self, slot: int, host_rows: list[int], rng: random.Random
    ) -> tuple[StepMetadata, int]:
        """A write meta for one request plus padding rows and trailing rows past ``n``."""
        q_pad = rng.random() < 0.5
        state = [slot] + ([-1] if q_pad else [])
        req_per_token = [0] * len(host_rows)
        mapping = list(host_rows)
        held = [g for g in self.model.hot[slot] if g >= 0 and g not in host_rows]
        # Padding rows naming rows this request holds, and rows that write nothing: they
        # must not invalidate anything.
        for _ in range(rng.randint(0, 2)):
            i = rng.randint(0, len(mapping))
            kind = rng.randint(0, 2)
            other = rng.choice(held) if held else 0
            if kind == 0:
                req_per_token.insert(i, -1)
                mapping.insert(i, other)
            elif kind == 1:
                req_per_token.insert(i, 0)
                mapping.insert(i, -1)
            elif q_pad:
                req_per_token.insert(i, 1)
                mapping.insert(i, other)
        n = len(mapping)
        # Trailing rows past num_rows name held rows of this request: must be ignored.
        tail = rng.sample(held, min(len(held), rng.randint(0, 2)))
        meta = StepMetadata(
            num_tokens=n + len(tail),
            is_decode=False,
            req_per_token=int32s(req_per_token + [0] * len(tail)),
            request_state_indices=int32s(state),
            source_block_table=torch.zeros((len(state), self.NB), dtype=torch.int32),
            host_slot_mapping=int32s(mapping + tail),
        )
        return meta, n

    def _check_resolved(
        self,
        want: Resolved,
        topk: list[list[int]],
        row_req: list[int],
        state: list[int],
        src_bt: list[list[int]],
        res_bt: list[list[int]],
        physical: torch.Tensor,
        valid: torch.Tensor,
        Q: int,
    ) -> None:
        g = self.group
        assert physical.tolist() == want.physical
        assert valid.tolist() == want.valid
        counts = [len(want.swaps.get(q, [])) for q in range(self.S)]
        assert g.swap_count.tolist() == counts
        for q in range(Q):
            n = counts[q]
            got = list(zip(g.swap_src[q, :n].tolist(), g.swap_dst[q, :n].tolist(), strict=True))
            assert got == want.swaps.get(q, [])
            assert [s for s, _ in got] == sorted(s for s, _ in got)
        hm = g.hit_miss[:Q].tolist()
        assert hm == [list(want.hit_miss.get(q, (0, 0))) for q in range(Q)]
        # Every physical row lies where the contract says.
        bs = self.bs
        for i, row in enumerate(topk):
            q = row_req[i]
            live = q >= 0 and state[q] >= 0
            for j, p in enumerate(row):
                r = want.physical[i][j]
                if not live or p < 0:
                    assert r == -1
                    continue
                page, off = divmod(p, bs)
                if res_bt[q][page]:
                    assert r == res_bt[q][page] * bs + off
                else:
                    s = state[q]
                    assert r // bs in self.model.hot_bt[s]
                    h = self.model.hot_bt[s].index(r // bs) * bs + r % bs
                    assert h < self.H
                    assert self.model.hot[s][h] == src_bt[q][page] * bs + off

    def _check_data(
        self,
        li: int,
        topk: list[list[int]],
        row_req: list[int],
        state: list[int],
        src_bt: list[list[int]],
        physical: list[list[int]],
    ) -> None:
        """Layer ``li``'s device row at each physical row == its host row of the position."""
        host, dev = self.host_views[li], self.dev_views[li]
        for i, row in enumerate(topk):
            q = row_req[i]
            if q < 0 or state[q] < 0:
                continue
            for j, p in enumerate(row):
                if p < 0:
                    continue
                g = src_bt[q][p // self.bs] * self.bs + p % self.bs
                assert row_bytes(dev, physical[i][j]) == row_bytes(host, g), (li, i, j, p)

    # --- rules -----------------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**32 - 1), how=st.sampled_from(["direct", "mirror"]))
    def start_request(self, seed: int, how: str) -> None:
        """A new request takes a free slot: reset, prompt written, maybe warm-started."""
        if len(self.reqs) < self.S:
            self._start(random.Random(seed), how)

    def _start(self, rng: random.Random, how: str) -> None:
        slot = rng.choice([s for s in range(self.S) if s not in self.reqs])
        self.group.reset_slot(slot)
        self.model.reset(slot)
        req = Req(slot=slot, blocks=[], resident=[], seq_len=0)
        # Prefix sharing: full, accepted pages of another live request (read-only here).
        donors = [r for r in self.reqs.values() if r.seq_len >= self.bs]
        if donors and rng.random() < 0.4:
            d = rng.choice(donors)
            for page in range(rng.randint(1, d.seq_len // self.bs)):
                req.blocks.append(d.blocks[page])
                req.resident.append(0)
                self.refcount[d.blocks[page]] += 1
        shared = len(req.blocks) * self.bs
        lo = max(shared, 1)
        prompt = rng.randint(lo, max(lo, self.NB * self.bs - 1))
        self._ensure_pages(req, prompt)
        for page in range(len(req.blocks)):
            self._make_resident(req, page)
        self.reqs[slot] = req
        positions = list(range(shared, prompt))
        if how == "direct" or not positions:
            rows = self._write_direct(req, positions, rng)
            meta, n = self._invalidate_meta(slot, rows, rng)
            self.group.invalidate_written(meta, num_rows=n)
            self.model.invalidate(slot, set(rows))
        else:
            self._prefill_through_handles(req, positions, rng)
        req.seq_len = prompt
        if rng.random() < 0.5:
            self._warm_start(req, rng)
        self._spill_old(req, rng, keep=rng.choice([0, 1, 2]))

    def _spill(self, req: Req, page: int) -> None:
        if req.resident[page]:
            self.free_dev.append(req.resident[page])
            req.resident[page] = 0

    def _spill_old(self, req: Req, rng: random.Random, keep: int) -> None:
        """Release resident pages but (mostly) the last ``keep``: the host holds them."""
        for page in range(len(req.blocks) - keep):
            if rng.random() < 0.8:
                self._spill(req, page)

    def _prefill_through_handles(self, req: Req, positions: list[int], rng: random.Random) -> None:
        """Prompt rows written to resident pages, mirrored by `finish_kv_update`."""
        bs = self.bs
        rows = [self._host_row(req, p) for p in positions]
        dev_rows = [req.resident[p // bs] * bs + p % bs for p in positions]
        meta = StepMetadata(
            num_tokens=len(positions),
            is_decode=False,
            req_per_token=int32s([0] * len(positions)),
            request_state_indices=int32s([req.slot]),
            source_block_table=int32s([self._padded(req.blocks)]),
            host_slot_mapping=int32s(rows),
        )
        tables = GroupTables(
            resident_block_table=int32s([self._padded(req.resident)]), slot_mapping=int32s(dev_rows)
        )
        self.handles[0].prepare_group_for_batch(meta, tables)
        for g in rows:
            self._bump(g)
        self.model.invalidate(req.slot, set(rows))
        for li, h in enumerate(self.handles):
            view, slots = h.write_target()
            assert slots.tolist() == dev_rows
            m = self.mem[li]
            for g, r in zip(rows, dev_rows, strict=True):
                data = rng.randbytes(self.W)
                set_row(view, r, data)
                m.put(m.dev, r, data)
                m.put(m.host, g, data)
            h.finish_kv_update()

    def _padded(self, values: list[int]) -> list[int]:
        return values + [0] * (self.NB - len(values))

    def _warm_start(self, req: Req, rng: random.Random) -> None:
        """Seed the hot buffer from the prompt's last selection, from the host pool (the
        engine's warm start: `IndexGroupRuntime.warm_start_from_host`)."""
        for page in range(len(req.blocks)):
            self._make_resident(req, page)
        rows = rng.randint(1, self.mql)
        topk = [self._selection(req, req.seq_len, rng, self.K) for _ in range(rows)]
        src_bt = [self._padded(req.blocks)]
        res_bt = [self._padded(req.resident)]
        meta = StepMetadata(
            num_tokens=rows,
            is_decode=False,
            req_per_token=int32s([0] * rows),
            request_state_indices=int32s([req.slot]),
            source_block_table=int32s(src_bt),
            host_slot_mapping=None,
        )
        tables = GroupTables(
            resident_block_table=int32s(res_bt),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int32),
        )
        self.handles[0].prepare_group_for_batch(meta, tables)
        self.handles[0].runtime.group.warm_start_from_host(meta, int32s(topk))
        want = self.model.resolve(topk, [0] * rows, [req.slot], src_bt, None, self.gen)
        bs = self.bs
        for i, row in enumerate(topk):
            for j, p in enumerate(row):
                if p < 0:
                    continue
                src = src_bt[0][p // bs] * bs + p % bs
                for m in self.mem:
                    m.put(m.dev, want.physical[i][j], m.get(m.host, src))
        req.recent = [p for row in topk for p in row if p >= 0]

    def _selection(self, req: Req, visible: int, rng: random.Random, k: int) -> list[int]:
        """A top-k row over positions < ``visible``: -1s, duplicates, reuse of recent picks."""
        out = []
        recent = [p for p in req.recent if p < visible]
        for _ in range(k):
            u = rng.random()
            if u < 0.15:
                out.append(-1)
            elif u < 0.25 and out:
                out.append(rng.choice(out))
            elif u < 0.6 and recent:
                out.append(rng.choice(recent))
            else:
                out.append(rng.randrange(visible))
        return out

    @rule(seed=st.integers(0, 2**32 - 1))
    def finish_request(self, seed: int) -> None:
        """A request ends: its host blocks go back (LIFO) and its slot is free, not reset."""
        if not self.reqs:
            return
        rng = random.Random(seed)
        slot = rng.choice(sorted(self.reqs))
        if self.reqs[slot].seq_len < self.NB * self.bs and rng.random() < 0.6:
            return  # most requests live on: finishing is one rule of five
        self._finish(slot)

    def _finish(self, slot: int) -> None:
        req = self.reqs.pop(slot)
        for blk in req.blocks:
            self.refcount[blk] -= 1
            if self.refcount[blk] == 0:
                self.free_host.append(blk)
        self.free_dev.extend(b for b in req.resident if b)

    @rule(seed=st.integers(0, 2**32 - 1))
    def spill_or_reload(self, seed: int) -> None:
        """Drop some resident pages (the host holds them) or bring some back."""
        if not self.reqs:
            return
        rng = random.Random(seed)
        for req in self.reqs.values():
            for page in range(len(req.blocks)):
                if rng.random() < 0.3:
                    if req.resident[page]:
                        self._spill(req, page)
                    else:
                        self._make_resident(req, page)

    @rule(seed=st.integers(0, 2**32 - 1))
    def rewrite_rows(self, seed: int) -> None:
        """Recompute: rewrite some of a request's own host rows directly, then invalidate."""
        if not self.reqs:
            return
        rng = random.Random(seed)
        req = self.reqs[rng.choice(sorted(self.reqs))]
        own = [p for p in range(req.seq_len) if self._own_block(req, p // self.bs)]
        if not own:
            return
        held = {g for g in self.model.hot[req.slot] if g >= 0}
        prefer = [p for p in own if self._host_row(req, p) in held]
        picks = rng.sample(own, min(len(own), rng.randint(1, 3)))
        if prefer:
            picks += rng.sample(prefer, min(len(prefer), 2))
        picks = sorted(set(picks))
        rows = self._write_direct(req, picks, rng)
        meta, n = self._invalidate_meta(req.slot, rows, rng)
        self.group.invalidate_written(meta, num_rows=n)
        self.model.invalidate(req.slot, set(rows))

    @rule(
        seed=st.integers(0, 2**32 - 1),
        decode=st.booleans(),
        full_k=st.booleans(),
        interleave=st.booleans(),
        repeats=st.integers(1, 6),
    )
    def steps(self, seed: int, decode: bool, full_k: bool, interleave: bool, repeats: int) -> None:
        """A few decode steps in a row, every check after each."""
        rng = random.Random(seed)
        for _ in range(repeats):
            # Keep the batch busy even when hypothesis disables the lifecycle rules.
            for slot in [s for s, r in self.reqs.items() if r.seq_len >= self.NB * self.bs]:
                if rng.random() < 0.7:
                    self._finish(slot)
            if len(self.reqs) < self.S and (not self.reqs or rng.random() < 0.15):
                self._start(rng, rng.choice(["direct", "mirror"]))
            self._step(rng, decode, full_k, interleave)
            self.state_matches_model()
            self.memory_matches_model()

    def _step(self, rng: random.Random, decode: bool, full_k: bool, interleave: bool) -> None:
        """One (speculative) decode step: write new rows, resolve, gather, accept some."""
        bs, S, mql = self.bs, self.S, self.mql
        k = self.K if full_k else rng.randint(1, self.K)
        cap = self.NB * bs
        runnable = [r for r in self.reqs.values() if r.seq_len < cap]
        chosen = [r for r in runnable if rng.random() < 0.85]
        rng.shuffle(chosen)
        pads = rng.randint(0, S - len(chosen))
        batch: list[Req | None] = [*chosen, *([None] * pads)]
        rng.shuffle(batch)
        Q = len(batch)
        state = [r.slot if r is not None else -1 for r in batch]
        src_bt, res_bt = [], []
        row_req: list[int] = []
        topk: list[list[int]] = []
        host_map: list[int] = []
        slot_map: list[int] = []
        new_rows: dict[int, int] = {}  # q -> number of new tokens
        for q, r in enumerate(batch):
            if r is None:
                n = rng.randint(0, mql)
                garbage = [rng.randint(1, self.num_host_blocks - 1) for _ in range(self.NB)]
                src_bt.append(garbage)
                res_bt.append([rng.choice([0, 1]) for _ in range(self.NB)])
                for _ in range(n):
                    row_req.append(q)
                    topk.append([rng.randrange(-1, cap) for _ in range(k)])
                    host_map.append(-1)
                    slot_map.append(-1)
                continue
            n = rng.randint(1, min(mql, cap - r.seq_len))
            new_rows[q] = n
            self._ensure_pages(r, r.seq_len + n)
            for p in range(r.seq_len, r.seq_len + n):
                self._make_resident(r, p // bs)  # new rows land in resident tail pages
            src_bt.append(self._padded(r.blocks))
            res_bt.append(self._padded(r.resident))
            for j in range(n):
                p = r.seq_len + j
                row_req.append(q)
                topk.append(self._selection(r, p + 1, rng, k))
                host_map.append(self._host_row(r, p))
                slot_map.append(r.resident[p // bs] * bs + p % bs)
        room = S * mql - len(row_req)
        for _ in range(rng.randint(0, room)):
            row_req.append(-1)
            topk.append([rng.randrange(-1, cap) for _ in range(k)])
            host_map.append(-1)
            slot_map.append(-1)
        if rng.random() < 0.3:  # rows in any order: the contract is by row order
            perm = list(range(len(row_req)))
            rng.shuffle(perm)
            row_req = [row_req[i] for i in perm]
            topk = [topk[i] for i in perm]
            host_map = [host_map[i] for i in perm]
            slot_map = [slot_map[i] for i in perm]
        T = len(row_req)
        meta = StepMetadata(
            num_tokens=T,
            is_decode=decode,
            req_per_token=int32s(row_req) if T else torch.zeros(0, dtype=torch.int32),
            request_state_indices=int32s(state) if Q else torch.zeros(0, dtype=torch.int32),
            source_block_table=torch.tensor(src_bt, dtype=torch.int32).reshape(Q, self.NB),
            host_slot_mapping=int32s(host_map) if T else torch.zeros(0, dtype=torch.int32),
        )
        tables = GroupTables(
            resident_block_table=torch.tensor(res_bt, dtype=torch.int32).reshape(Q, self.NB),
            slot_mapping=int32s(slot_map) if T else torch.zeros(0, dtype=torch.int32),
        )
        # Model: the step's writes (new generation; the writer's hot copies are dropped).
        written: dict[int, set[int]] = {}
        for i, g in enumerate(host_map):
            if g >= 0:
                self._bump(g)
                written.setdefault(state[row_req[i]], set()).add(g)
        for s, rows in written.items():
            self.model.invalidate(s, rows)
        contents = [[rng.randbytes(self.W) for _ in range(T)] for _ in range(self.L)]
        for li, m in enumerate(self.mem):
            for i, r in enumerate(slot_map):
                if r >= 0:
                    m.put(m.dev, r, contents[li][i])
                    m.put(m.host, host_map[i], contents[li][i])
        # Model resolve and gathers (no gathered row is written this step: new rows land in
        # resident pages of blocks nobody shares, so the runtime's order does not matter).
        want = self.model.resolve(topk, row_req, state, src_bt, res_bt, self.gen)
        for swaps in want.swaps.values():
            for g, dst in swaps:
                for m in self.mem:
                    m.put(m.dev, dst, m.get(m.host, g))
        hits = sum(h for h, _ in want.hit_miss.values())
        misses = sum(m for _, m in want.hit_miss.values())
        self.model.totals[0] += hits
        self.model.totals[1] += misses
        self.model.totals[2] += misses * self.L
        topk_t = torch.tensor(topk, dtype=torch.int32).reshape(T, k)

        def write(li: int) -> None:
            view, slots = self.handles[li].write_target()
            for i, r in enumerate(slots.tolist()):
                if r >= 0:
                    set_row(view, r, contents[li][i])
            self.handles[li].finish_kv_update()

        def attend(li: int) -> None:
            physical, valid = self.handles[li].swap_in(topk_t, return_valid_counts=True)
            if li == 0:
                self._check_resolved(want, topk, row_req, state, src_bt, res_bt, physical, valid, Q)
            else:
                assert physical.tolist() == want.physical
            self._check_data(li, topk, row_req, state, src_bt, want.physical)

        self.handles[0].prepare_group_for_batch(meta, tables)
        if interleave:  # model order: layer by layer, write then attend
            for li in range(self.L):
                write(li)
                attend(li)
        else:
            for li in range(self.L):
                write(li)
            for li in range(self.L):
                attend(li)
        # Acceptance: speculative rows past the accepted ones are rewritten next step.
        for q, n in new_rows.items():
            r = batch[q]
            assert r is not None
            r.seq_len += rng.randint(1, n)
            picked = [p for i, row in enumerate(topk) if row_req[i] == q for p in row if p >= 0]
            r.recent = list(dict.fromkeys(picked + r.recent))[: 2 * self.H]
            self._spill_old(r, rng, keep=rng.choice([1, 2]))

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def state_matches_model(self) -> None:
        if not self.ready:
            return
        g, m = self.group, self.model
        assert g.hot_index.tolist() == m.hot
        assert g.lru.tolist() == m.lru
        assert g.totals.tolist() == m.totals
        for s in range(self.S):
            lru = g.lru[s].tolist()
            assert sorted(lru) == list(range(self.H)), f"lru of slot {s} is no permutation"
            held = [x for x in g.hot_index[s].tolist() if x >= 0]
            assert len(held) == len(set(held)), f"slot {s} holds a host row twice"
            if s in self.reqs:  # live: nothing held was rewritten since its copy
                for h, x in enumerate(m.hot[s]):
                    if x >= 0:
                        assert m.copied_gen[s][h] == self.gen[x], f"stale row {x} in slot {s}"

    @invariant()
    def memory_matches_model(self) -> None:
        if not self.ready:
            return
        for li, mem in enumerate(self.mem):
            for what, view, want in (
                ("host", self.host_views[li], mem.host),
                ("device", self.dev_views[li], mem.dev),
            ):
                got = view_bytes(view)
                if got != want:
                    W = self.W
                    row = next(
                        i
                        for i in range(len(got) // W)
                        if got[i * W : (i + 1) * W] != want[i * W : (i + 1) * W]
                    )
                    raise AssertionError(
                        f"layer {li} {what} row {row}: runtime {got[row * W : (row + 1) * W]!r}"
                        f" != model {bytes(want[row * W : (row + 1) * W])!r}"
                    )


class CpuOpsRuntimeMachine(RuntimeMachine):
    OPS = cpu_backend()


_MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
RuntimeMachine.TestCase.settings = _MACHINE_SETTINGS
CpuOpsRuntimeMachine.TestCase.settings = _MACHINE_SETTINGS
TestRuntimeAgainstModel = RuntimeMachine.TestCase
TestRuntimeWithCpuOpsAgainstModel = CpuOpsRuntimeMachine.TestCase
