"""What the Triton data-plane kernels share: the interpreter check and its fix, programmatic
dependent launches (Hopper), and the stages both resolve kernels (`triton_resolve`,
`triton_resolve_split`) run the same way.

Importing this module applies the interpreter fix when ``TRITON_INTERPRET`` is set, so every
module that defines kernels imports it first.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from hisparse import envs


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_index() -> None:
    """Let the interpreter use a scalar as a loop bound with numpy >= 2.4.

    Triton 3.6's interpreter keeps scalars as 1-element arrays and converts them for
    ``range`` with ``int(array)``, which numpy 2.4 refuses ("only 0-dimensional arrays can be
    converted"); take the element instead. Only touches the interpreter.
    """
    from triton.runtime import interpreter as interp

    orig = interp._patch_lang_tensor
    if getattr(orig, "_hisparse_fixed", False):
        return

    def patched(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._hisparse_fixed = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patched


if interpreting():
    _fix_interpreter_index()


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents of the kernel before
    them (Hopper and later; CUDA, not the interpreter; ``HISPARSE_PDL=0`` turns it off for
    A/B runs). Such a kernel starts while the one before it finishes and waits for it with
    `grid_dependency_wait` before reading what it wrote: no launch gap between short kernels
    of one chain, also inside a CUDA graph."""
    if device.type != "cuda" or interpreting() or not envs.value("HISPARSE_PDL"):
        return False
    return _hopper_or_later(device)


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel that calls `grid_dependency_wait(GDC)` first: ``GDC``
    and ``launch_pdl`` where `dependent_launch` holds, else ``GDC=False`` (a plain launch)."""
    if dependent_launch(device):
        return {"GDC": True, "launch_pdl": True}
    return {"GDC": False}


@triton.jit
def grid_dependency_wait(ON: tl.constexpr):
    """With ``ON`` (the kernel launched by `dependent_launch`): wait until the kernel before
    finished and its writes are visible, then let the next one start launching (it waits
    the same way). Call first, before reading anything an earlier kernel wrote."""
    if ON:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): block shapes are powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def add_totals(totals_ptr, n_hit, n_miss, n_layers):
    """Add one request's hits, misses and rows moved (misses × layers) to the int64 running
    ``totals [3]`` of its index group (atomics: every request's program adds its own)."""
    tl.atomic_add(totals_ptr, n_hit.to(tl.int64), sem="relaxed")
    tl.atomic_add(totals_ptr + 1, n_miss.to(tl.int64), sem="relaxed")
    tl.atomic_add(totals_ptr + 2, n_miss.to(tl.int64) * n_layers, sem="relaxed")


@triton.jit
def zero_count_tails(
    Q, swap_count_ptr, s_sc, n_sc, hm_ptr, s_hm_q, s_hm_c, n_hm, HAS_HM: tl.constexpr
):  # fmt: skip
    """Zero the swap counts and hit/miss counters of state rows ``Q..`` past this call's
    requests (buffers sized for more feed the gathers' fixed grids); one program calls it,
    in the resolve's first launch instead of two fills of its own."""
    BT: tl.constexpr = 128
    t = tl.arange(0, BT)
    for i0 in range(Q, n_sc, BT):
        i = (i0 + t).to(tl.int64)
        tl.store(swap_count_ptr + i * s_sc, 0, mask=i < n_sc)
    if HAS_HM:
        for i0 in range(Q, n_hm, BT):
            i = (i0 + t).to(tl.int64)
            tl.store(hm_ptr + i * s_hm_q, 0, mask=i < n_hm)
            tl.store(hm_ptr + i * s_hm_q + s_hm_c, 0, mask=i < n_hm)


@triton.jit
def hash_bucket(g, LOGB: tl.constexpr):
    """Fibonacci hash of host rows (``0 <= g < 2**31``) into ``[0, 2**LOGB)`` buckets."""
    return (((g.to(tl.int64) * 2654435761) & 0xFFFFFFFF) >> (32 - LOGB)).to(tl.int32)


@triton.jit
def padding_rows_and_row_list(
    q, write_padding, row_req_ptr, R, state_ptr, Q, out_ptr, s_out_r, s_out_c, valid_ptr, s_v,
    K, rows_ptr, KP: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr,
    HAS_VALID: tl.constexpr,
):  # fmt: skip
    """With ``write_padding``, write rows ``q, q + Q, ...`` of padding (or out-of-range)
    requests as ``-1``; then list request ``q``'s rows in row order at ``rows_ptr`` (programs
    that list the same request write the same values) and return their count."""
    if write_padding:
        cols = tl.arange(0, KP)
        for r in range(q, R, Q):
            rq = tl.load(row_req_ptr + r)
            in_range = (rq >= 0) & (rq < Q)
            st = tl.load(state_ptr + tl.where(in_range, rq, 0))
            dead = (~in_range) | (st < 0)
            r64 = tl.cast(r, tl.int64)
            tl.store(
                out_ptr + r64 * s_out_r + cols * s_out_c,
                tl.full([KP], -1, tl.int32),
                mask=(cols < K) & dead,
            )
            if HAS_VALID:
                tl.store(valid_ptr + r64 * s_v, 0, mask=dead)
    n_rows = 0
    br = tl.arange(0, BR)
    for r0 in range(0, R, BR):
        offs = r0 + br
        rq = tl.load(row_req_ptr + offs, mask=offs < R, other=-1)
        mine = rq == q
        rank = n_rows + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(rows_ptr + rank, offs, mask=mine & (rank < ROWS))
        n_rows += tl.sum(mine.to(tl.int32), 0)
    return tl.minimum(n_rows, ROWS)


@triton.jit
def decode_entries(
    e, rows_ptr, n_rows, topk_ptr, stk_r, stk_c, src_bt_row, s_src_b, res_bt_row, s_res_b,
    out_ptr, s_out_r, s_out_c, K, bs, KP: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """A request's entries ``e`` (row ``e // KP`` of its row list, column ``e % KP``):
    ``(row, col, valid, needs, g)`` with ``g`` the host row; entries that need no hot slot
    (resident, or ``-1``) get their physical row or ``-1`` written at once."""
    ri = e // KP
    col = e % KP
    row_ok = ri < n_rows
    row = tl.load(rows_ptr + ri, mask=row_ok, other=0).to(tl.int64)
    emask = row_ok & (col < K)
    pv = tl.load(topk_ptr + row * stk_r + col * stk_c, mask=emask, other=-1).to(tl.int64)
    valid = pv >= 0
    pc = tl.maximum(pv, 0)
    blk = pc // bs
    off = pc % bs
    sblk = tl.load(src_bt_row + blk * s_src_b, mask=valid, other=0)
    g = (sblk.to(tl.int64) * bs + off).to(tl.int32)
    addr = out_ptr + row * s_out_r + col * s_out_c
    if HAS_RES:
        rblk = tl.load(res_bt_row + blk * s_res_b, mask=valid, other=0).to(tl.int64)
        needs = valid & (rblk == 0)
        tl.store(addr, tl.where(valid, rblk * bs + off, -1), mask=emask & ~needs)
    else:
        needs = valid
        tl.store(addr, -1, mask=emask & ~needs)
    return row, col, valid, needs, g
