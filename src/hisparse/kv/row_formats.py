"""Byte encodings of one token's cache row: MLA KV rows and lightning-indexer keys.

Every tier (host pool, resident pages, hot buffer) stores the same bytes, so one pair of
pack/unpack functions per format is the single source of truth; the Triton kernels decode the
same layout in-register. Layouts (docs/design.md §3):

- ``fp8_ds_mla`` (656 B at 512/64): ``[0, C)`` e4m3 latent, then ``C / 128`` fp32 scales
  (``amax × (1/448)`` of each 128-value tile), then the RoPE part as bf16.
- ``bf16`` (1152 B): latent then RoPE, bf16.
- ``fp32`` (2304 B): latent then RoPE, fp32. Test/reference only: it keeps a float32 model's
  cache bit-exact, so a paged decode can be compared with a dense fp32 forward at float
  tolerance (bf16 rows alone would add ~2^-9 relative error per value).
- Indexer pages: per block, ``block_size x D`` e4m3 key bytes, then ``block_size`` fp32
  scales (``D = 128``: 132 B per token), keys and scales not interleaved per token. The
  ``exact`` indexer keeps plain fp32 keys (``4 D`` B per token) instead.

All functions accept arbitrary leading dimensions and work on CPU and CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.kv.specs import RowFormat

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3 value; a tile's scale maps its absolute maximum onto it.
FP8_MAX = 448.0
#: Values per fp32 scale in the fp8_ds_mla latent.
MLA_TILE = 128
#: Name of the test-only float32 MLA row format (not a `RowFormat`: no tier stores it in
#: production, but the same code paths accept it).
FP32_MLA = "fp32"

MlaFormat = RowFormat | str


# ---------------------------------------------------------------------------------------------
# MLA rows
# ---------------------------------------------------------------------------------------------
def mla_format_name(fmt: MlaFormat) -> str:
    """Canonical name (``fp8_ds_mla`` / ``bf16`` / ``fp32``) of an MLA row format."""
    name = fmt.value if isinstance(fmt, RowFormat) else str(fmt)
    if name not in (RowFormat.FP8_DS_MLA.value, RowFormat.BF16_MLA.value, FP32_MLA):
        raise ValueError(f"{fmt!r} is not an MLA row format (fp8_ds_mla, bf16, fp32)")
    return name


def mla_row_bytes(fmt: MlaFormat, kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes of one token's MLA row in ``fmt``."""
    name = mla_format_name(fmt)
    if name == RowFormat.FP8_DS_MLA.value:
        _check_fp8_latent(kv_lora_rank)
        return kv_lora_rank + 4 * (kv_lora_rank // MLA_TILE) + 2 * rope_dim
    if name == RowFormat.BF16_MLA.value:
        return 2 * (kv_lora_rank + rope_dim)
    return 4 * (kv_lora_rank + rope_dim)


def mla_dims_from_row_bytes(fmt: MlaFormat, row_bytes: int, rope_dim: int = 64) -> int:
    """The latent width (``kv_lora_rank``) that gives ``row_bytes`` in ``fmt``."""
    name = mla_format_name(fmt)
    if name == RowFormat.FP8_DS_MLA.value:
        # C + C/32 + 2R = row_bytes  ->  C = 32 (row_bytes - 2R) / 33
        c = 32 * (row_bytes - 2 * rope_dim) // 33
    elif name == RowFormat.BF16_MLA.value:
        c = row_bytes // 2 - rope_dim
    else:
        c = row_bytes // 4 - rope_dim
    if c <= 0 or mla_row_bytes(name, c, rope_dim) != row_bytes:
        raise ValueError(f"{row_bytes} B is not a {name} row with rope_dim={rope_dim}")
    return c


def _check_fp8_latent(kv_lora_rank: int) -> None:
    if kv_lora_rank % MLA_TILE:
        raise ValueError(
            f"fp8_ds_mla needs kv_lora_rank to be a multiple of {MLA_TILE}; got {kv_lora_rank}"
        )


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret the last dim of a contiguous tensor as bytes."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a byte slice as ``dtype`` (copied first: slices of a row are unaligned views)."""
    return b.contiguous().view(dtype)


def fp8_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[256]``: the value of each e4m3 code as torch converts it (cached per device), for
    decoding fp8 bytes by table lookup, which on the CPU is several times faster than the cast."""
    device = torch.device(device)
    table = _FP8_VALUES.get(device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = _FP8_VALUES[device] = codes.view(FP8_DTYPE).float().to(device)
    return table


_FP8_VALUES: dict[torch.device, torch.Tensor] = {}


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= x`` for normal fp32 ``x > 0`` (a subnormal gives the
    least normal, ``2^-126``), read off the exponent bits: DeepSeek's ue8m0 rounding, where
    ``exp2(ceil(log2(x)))`` can round ``log2`` down to an integer just above a power of two."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def quantize_fp8_tiles(
    x: torch.Tensor, tile: int = MLA_TILE, *, pow2_scale: bool = False, min_amax: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one fp32 scale per ``tile`` values along the last dim.

    ``scale = amax × (1/448)`` (rounded up to a power of two with ``pow2_scale``, as DeepSeek's
    ``ue8m0`` activations); an all-zero tile gets scale 0 and zero bytes unless ``min_amax``
    floors it. Returns ``(values [..., D] e4m3, scales [..., D / tile] fp32)``.
    """
    d = x.shape[-1]
    if d % tile:
        raise ValueError(f"last dim {d} is not a multiple of the tile {tile}")
    xt = x.float().reshape(*x.shape[:-1], d // tile, tile)
    amax = xt.abs().amax(dim=-1)
    if min_amax > 0:
        amax = amax.clamp(min=min_amax)
    scale = amax * (1.0 / FP8_MAX)  # a product: CUDA divides by a scalar this way anyway
    if pow2_scale:
        scale = torch.where(scale > 0, ceil_pow2(scale), scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xt / safe.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def dequantize_fp8_tiles(
    q: torch.Tensor, scale: torch.Tensor, tile: int = MLA_TILE
) -> torch.Tensor:
    """Inverse of `quantize_fp8_tiles` (up to the e4m3 rounding), in fp32."""
    d = q.shape[-1]
    qt = q.float().reshape(*q.shape[:-1], d // tile, tile)
    return (qt * scale.float().unsqueeze(-1)).reshape(q.shape)


def pack_mla_rows(fmt: MlaFormat, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``latent [..., C]`` and ``rope [..., R]`` -> rows ``[..., row_bytes]`` uint8 in ``fmt``."""
    name = mla_format_name(fmt)
    if latent.shape[:-1] != rope.shape[:-1]:
        raise ValueError(f"latent {tuple(latent.shape)} and rope {tuple(rope.shape)} disagree")
    c, r = latent.shape[-1], rope.shape[-1]
    if name == RowFormat.FP8_DS_MLA.value:
        _check_fp8_latent(c)
        q, scale = quantize_fp8_tiles(latent)
        parts = [_as_bytes(q), _as_bytes(scale), _as_bytes(rope.to(torch.bfloat16))]
    elif name == RowFormat.BF16_MLA.value:
        parts = [_as_bytes(latent.to(torch.bfloat16)), _as_bytes(rope.to(torch.bfloat16))]
    else:
        parts = [_as_bytes(latent.to(torch.float32)), _as_bytes(rope.to(torch.float32))]
    rows = torch.cat(parts, dim=-1)
    assert rows.shape[-1] == mla_row_bytes(name, c, r)
    return rows


def unpack_mla_rows(
    fmt: MlaFormat, rows: torch.Tensor, kv_lora_rank: int = 512, rope_dim: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., row_bytes]`` uint8 -> ``(latent [..., C], rope [..., R])`` in fp32."""
    name = mla_format_name(fmt)
    c, r = kv_lora_rank, rope_dim
    expected = mla_row_bytes(name, c, r)
    if rows.dtype != torch.uint8 or rows.shape[-1] != expected:
        raise ValueError(
            f"{name} rows must be uint8 [..., {expected}]; got {rows.dtype} {tuple(rows.shape)}"
        )
    if name == RowFormat.FP8_DS_MLA.value:
        n_scales = c // MLA_TILE
        q = _from_bytes(rows[..., :c], FP8_DTYPE)
        scale = _from_bytes(rows[..., c : c + 4 * n_scales], torch.float32)
        latent = dequantize_fp8_tiles(q, scale)
        rope = _from_bytes(rows[..., c + 4 * n_scales :], torch.bfloat16).float()
    elif name == RowFormat.BF16_MLA.value:
        latent = _from_bytes(rows[..., : 2 * c], torch.bfloat16).float()
        rope = _from_bytes(rows[..., 2 * c :], torch.bfloat16).float()
    else:
        latent = _from_bytes(rows[..., : 4 * c], torch.float32)
        rope = _from_bytes(rows[..., 4 * c :], torch.float32)
    return latent, rope


# ---------------------------------------------------------------------------------------------
# Indexer key pages
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexerCacheFormat:
    """How one indexer key is stored: ``fp8`` (e4m3 + fp32 scales per tile) or ``fp32``."""

    kind: str  # "fp8" | "fp32"
    head_dim: int = 128
    #: Values per fp8 scale (DeepSeek: 128, one scale per 128-dim key).
    tile: int = 128

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "fp32"):
            raise ValueError(f"indexer cache kind {self.kind!r}: expected 'fp8' or 'fp32'")
        if self.kind == "fp8" and self.head_dim % self.tile:
            raise ValueError(f"index_head_dim {self.head_dim} is not a multiple of {self.tile}")

    @classmethod
    def for_mode(cls, mode: str, head_dim: int) -> IndexerCacheFormat:
        """The key format an indexer mode reads: ``fp8`` -> e4m3 pages, ``exact`` -> fp32."""
        if mode == "fp8":
            return cls("fp8", head_dim, min(128, head_dim))
        if mode == "exact":
            return cls("fp32", head_dim)
        raise ValueError(f"indexer mode {mode!r}: expected 'exact' or 'fp8'")

    @property
    def scales_per_row(self) -> int:
        return self.head_dim // self.tile if self.kind == "fp8" else 0

    @property
    def row_bytes(self) -> int:
        """Bytes per token (132 for DeepSeek's fp8 keys)."""
        if self.kind == "fp8":
            return self.head_dim + 4 * self.scales_per_row
        return 4 * self.head_dim

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.row_bytes


def _page_parts(
    pages: torch.Tensor, fmt: IndexerCacheFormat
) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(block_size, key byte region [NB, BS, key_bytes], scale region [NB, BS, 4 n] or None)."""
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] % fmt.row_bytes:
        raise ValueError(
            f"indexer pages must be uint8 [num_blocks, block_size * {fmt.row_bytes}]; got "
            f"{pages.dtype} {tuple(pages.shape)}"
        )
    nb, page = pages.shape
    bs = page // fmt.row_bytes
    if fmt.kind == "fp32":
        return bs, pages.view(nb, bs, fmt.row_bytes), None
    key_bytes = bs * fmt.head_dim
    keys = pages[:, :key_bytes].unflatten(1, (bs, fmt.head_dim))
    scales = pages[:, key_bytes:].unflatten(1, (bs, 4 * fmt.scales_per_row))
    return bs, keys, scales


def write_rows_where(region: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``region[s // bs, s % bs] = values`` for every slot ``s >= 0``, with no host sync.

    ``region`` is ``[num_blocks, bs, ...]``. A boolean-mask select would read the kept count
    back to the host (a sync per layer, and an error under CUDA-graph capture); instead rows
    with ``s < 0`` rewrite row 0 of the null block 0 (never a real row) with its own bytes.
    """
    bs = region.shape[1]
    keep = slots >= 0
    s = torch.where(keep, slots.long(), 0)
    blk, off = s // bs, s % bs
    shape = (-1,) + (1,) * (values.dim() - 1)
    region[blk, off] = torch.where(keep.view(shape), values, region[blk, off])


def _byte_rows(region: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``values [N, R]`` and ``region [blocks, bs, R]`` are uint8 rows that 16-byte
    word copies can move (`scatter_rows`' kernel)."""
    return (
        region.dtype == values.dtype == torch.uint8
        and region.dim() == 3
        and values.dim() == 2
        and values.shape[1] == region.shape[2]
        and region.stride(2) == 1
        and values.stride(1) == 1
        and all(x % 16 == 0 for x in (region.shape[2], *region.stride()[:2], values.stride(0)))
        and region.data_ptr() % 16 == 0
        and values.data_ptr() % 16 == 0
    )


def write_rows_fast(region: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """`write_rows_where` for the GQA decode rows, in fewer ops where a host read is free.

    On the CPU, reading the slots costs no sync, so kept rows are written by plain indexing
    (one slot: a single row copy) instead of the read-modify-write of every row that keeps a
    CUDA step sync-free. Other devices take the data-plane op `scatter_rows` (on CUDA one
    Triton launch; byte rows of 16-byte multiples), anything else `write_rows_where`.
    """
    if region.device.type != "cpu":
        if _byte_rows(region, values):
            from hisparse.runtime.ops import ops_for

            ops_for(region.device).scatter_rows(values, region, slots)
        else:
            write_rows_where(region, slots, values)
        return
    bs = region.shape[1]
    if slots.numel() == 1:  # batch-1 decode
        s = int(slots.reshape(()))
        if s >= 0:
            region[s // bs, s % bs] = values.reshape(region.shape[2:])
        return
    s = slots.long()
    if not bool((s >= 0).all()):
        write_rows_where(region, slots, values)
        return
    region[s // bs, s % bs] = values


def write_indexer_keys(
    pages: torch.Tensor,
    fmt: IndexerCacheFormat,
    slots: torch.Tensor,
    keys: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """Store keys at physical rows ``slots`` (``block * block_size + offset``; ``< 0`` skipped).

    fp8: ``keys`` are e4m3 ``[N, D]`` with ``scales [N, D / tile]`` (already quantized: the
    quantization belongs to the indexer mode). fp32: ``keys [N, D]`` float. No host sync.
    """
    _, key_region, scale_region = _page_parts(pages, fmt)
    if fmt.kind == "fp32":
        write_rows_where(key_region, slots, _as_bytes(keys.to(torch.float32)))
        return
    if scales is None:
        raise ValueError("fp8 indexer keys need their scales")
    assert scale_region is not None
    write_rows_where(key_region, slots, _as_bytes(keys.to(FP8_DTYPE)))
    write_rows_where(
        scale_region,
        slots,
        _as_bytes(scales.to(torch.float32).reshape(-1, fmt.scales_per_row)),
    )


def read_indexer_keys(
    pages: torch.Tensor, fmt: IndexerCacheFormat, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys at physical rows ``rows`` (any shape, all ``>= 0``).

    Returns ``(keys [..., D], scales [..., D / tile])`` for fp8 (e4m3 keys) or
    ``(keys [..., D] fp32, None)``.
    """
    bs, key_region, scale_region = _page_parts(pages, fmt)
    rows = rows.long()
    blk, off = rows // bs, rows % bs
    if fmt.kind == "fp32":
        return _from_bytes(key_region[blk, off], torch.float32), None
    assert scale_region is not None
    keys = _from_bytes(key_region[blk, off], FP8_DTYPE)
    scales = _from_bytes(scale_region[blk, off], torch.float32)
    return keys, scales
