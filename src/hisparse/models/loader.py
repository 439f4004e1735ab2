"""Load a DSA checkpoint (config.json + safetensors) into `DsaForCausalLM`, one rank's shard.

The model is built on the meta device, fp8 layers swapped in where the checkpoint keeps fp8
weights, then sharded to this rank's shapes (`hisparse.parallel.shard.shard_dsa`); every
parameter is then allocated on the target device at its final shape and filled from the
rank's slices of the checkpoint's tensors, read through the files' memory maps
(`checkpoint.SliceReader`): the host never holds the whole model, only a slice at a time
while it is copied (design §18.2).

Accepted layouts and names:

- one ``model.safetensors``, or shards listed in ``model.safetensors.index.json`` (any other
  ``*.safetensors`` files in the folder when neither exists);
- per-expert tensors ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (the releases
  and what transformers' ``save_pretrained`` writes) or fused 3-D expert tensors
  ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``;
- fp8 block-scaled weights: an e4m3 ``X`` with ``X_scale_inv`` (one fp32 factor per 128 x 128
  tile, ``quantization_config`` of DeepSeek's format): kept fp8 (`Fp8Linear`, `Fp8Experts`)
  for the attention, indexer, MLP and expert projections; dequantized once at load where the
  model needs the values (MLA's absorbed ``kv_b_proj``, and every weight with
  ``fp8="dequantize"``);
- layers past ``num_hidden_layers``: the multi-token-prediction layer(s), kept (`mtp`); their
  copies of the embedding and LM head are skipped (`shared_copies`: the model's are shared).

A missing, unexpected, mis-shaped or mis-scaled tensor raises `CheckpointError` naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hisparse.models import fp8
from hisparse.models.checkpoint import (
    CheckpointError,
    CheckpointIndex,
    LoadProgress,
    SliceReader,
    checkpoint_files,
    progress_console,
)
from hisparse.models.deepseek_v32 import DsaForCausalLM, Indexer, MoE, Rotary, Router
from hisparse.models.dsa_config import DsaConfig
from hisparse.models.fp8_linear import Fp8Linear
from hisparse.models.fp8_moe import Fp8Experts
from hisparse.models.mtp import MtpLayer, mtp_prefix

__all__ = ["CheckpointError", "build_dsa_model", "checkpoint_files", "load_dsa_model"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
#: linear layers kept in fp8 where the checkpoint has them so (others are dequantized)
_FP8_KEPT = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "wq_b", "wk",
             "gate_proj", "up_proj", "down_proj", "eh_proj"}  # fmt: skip
FP8_MODES = ("keep", "dequantize")


def _check_scale_shape(name: str, w: tuple[int, ...], s: tuple[int, ...]) -> None:
    want = (*w[:-2], fp8.cdiv(w[-2], fp8.BLOCK), fp8.cdiv(w[-1], fp8.BLOCK)) if len(w) >= 2 else ()
    if s != want:
        raise CheckpointError(
            f"{name}: fp8 scale shape {s} does not tile weight {w} in "
            f"{fp8.BLOCK}x{fp8.BLOCK} blocks (expected {want})"
        )


def _scale_key(key: str) -> str:
    return key + "_scale_inv"


@dataclass
class _Piece:
    """One read: checkpoint tensor ``key[src]`` into ``param[dst]`` (``scale``: dequantize
    with that scale tensor's tiles; ``zero``: fill with zeros, read nothing)."""

    key: str
    src: tuple[Any, ...]
    dst: tuple[Any, ...] = ()
    scale: str | None = None
    zero: bool = False


def _slices(shape: tuple[int, ...], split: tuple[int, int, int] | None, lead: int = 0
            ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
    """``(src, dst)`` indices of a rank's part of a tensor of ``shape`` whose dim ``dim -
    lead`` is split (``lead``: leading dims of the parameter the tensor does not have)."""
    src: list[Any] = [slice(0, n) for n in shape]
    dst: list[Any] = [slice(None)] * len(shape)
    if split is not None:
        dim, start, length = split
        d = dim - lead
        stop = min(start + length, shape[d])
        src[d] = slice(start, max(start, stop))
        dst[d] = slice(0, max(0, stop - start))
    return tuple(src), tuple(dst)


class _Plan:
    """Which checkpoint slices fill which parameters, and what the checkpoint must hold."""

    def __init__(self, ckpt: CheckpointIndex, config: DsaConfig) -> None:
        self.ckpt, self.config = ckpt, config
        self.pieces: dict[str, list[_Piece]] = {}
        self.expect: dict[str, tuple[int, ...]] = {}  # checkpoint key -> its full shape
        self.missing: list[str] = []
        #: checkpoint keys another rank reads (its experts, under expert parallelism)
        self.skipped: set[str] = set()

    def hf(self, name: str) -> str:
        return _hf_name(self.config, name)

    def add(self, name: str, key: str, full: tuple[int, ...], split: Any, *, lead: int = 0,
            dst_lead: tuple[Any, ...] = (), src_lead: tuple[Any, ...] = (),
            dequant: bool | None = None) -> None:  # fmt: skip
        """Read ``key`` (full shape ``full``) into parameter ``name``."""
        info = self.ckpt.get(key)
        self.expect[key] = full  # the key's whole shape as the model implies
        if info is None:
            self.missing.append(key)
            return
        shape = info.shape[len(src_lead) :]
        src, dst = _slices(shape, split, lead)
        is_fp8 = info.dtype == torch.float8_e4m3fn
        scale = _scale_key(key) if (is_fp8 if dequant is None else dequant) else None
        self.pieces.setdefault(name, []).append(
            _Piece(key, src_lead + src, dst_lead + dst, scale=scale)
        )

    def plain(self, name: str, full: tuple[int, ...], split: Any) -> None:
        key = self.hf(name)
        fused = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", key)
        if fused and key not in self.ckpt:
            prefix, e, kind = fused.group(1), int(fused.group(2)), fused.group(3)
            self._fused_expert(name, prefix, kind, full, split, src_lead=(e,))
            return
        if name == "lm_head.weight" and key not in self.ckpt and self.config.tie_word_embeddings:
            key = "model.embed_tokens.weight"
        self.add(name, key, full, split)

    def _fused_expert(self, name: str, prefix: str, kind: str, full: tuple[int, ...],
                      split: Any, src_lead: tuple[Any, ...] = (),
                      dequant: bool | None = None) -> None:  # fmt: skip
        """Read an expert weight (``full``: one expert's ``[rows, cols]``, or all experts'
        ``[E, rows, cols]`` for `Fp8Experts`) from transformers' fused 3-D tensors: gate and
        up are the two halves of ``gate_up_proj [E, 2I, H]``, down is ``down_proj [E, H, I]``
        (``src_lead``: the expert's index when one expert is read)."""
        n_exp = self.config.n_routed_experts
        *_, rows, cols = full
        if kind == "down":
            self.add(name, f"{prefix}.down_proj", (n_exp, rows, cols), split,
                     dequant=dequant, src_lead=src_lead)  # fmt: skip
            return
        base = 0 if kind == "gate" else rows
        dim, start, length = split if split is not None else (len(full) - 2, 0, rows)
        self.add(name, f"{prefix}.gate_up_proj", (n_exp, 2 * rows, cols),
                 (dim, base + start, length), dequant=dequant, src_lead=src_lead)  # fmt: skip

    def experts(self, name: str, ex: Fp8Experts, attr: str, full: tuple[int, ...],
                split: Any) -> None:  # fmt: skip
        """`Fp8Experts` parameter ``attr``: expert ``e``'s tensor into row ``e``."""
        prefix = self.hf(name).rsplit(".fp8_experts.", 1)[0] + ".experts"
        part, what = attr.split("_")
        per_expert = f"{prefix}.0.{part}_proj.weight"
        if per_expert not in self.ckpt and f"{prefix}.gate_up_proj" in self.ckpt:
            if what == "weight":
                self._fused_expert(name, prefix, part, full, split, dequant=False)
                return
            # the fused tensors' scales: gate's tiles, then up's (whole tiles only)
            if part == "down":
                self.add(name, f"{prefix}.down_proj_scale_inv", full, split, dequant=False)
                return
            key = f"{prefix}.gate_up_proj_scale_inv"
            if self.config.moe_intermediate_size % fp8.BLOCK:
                raise CheckpointError(f"{key}: the up projection's rows start inside a tile")
            tiles = full[1]
            base = 0 if part == "gate" else tiles
            dim, start, length = split if split is not None else (1, 0, tiles)
            self.add(name, key, (full[0], 2 * tiles, full[2]), (dim, base + start, length),
                     dequant=False)  # fmt: skip
            return
        first = ex.first_expert  # expert parallelism: this rank's experts only
        for j in range(full[0]):
            key = f"{prefix}.{first + j}.{part}_proj.weight"
            key = key if what == "weight" else _scale_key(key)
            self.add(name, key, full[1:], split, lead=1, dst_lead=(j,), dequant=False)


def build_dsa_model(
    config: DsaConfig,
    ckpt: CheckpointIndex,
    *,
    indexer_mode: str = "exact",
    fp8_format: fp8.Fp8Format | None = None,
) -> DsaForCausalLM:
    """The model of ``config`` on the meta device, with the checkpoint's MTP layers and, given
    ``fp8_format``, `Fp8Linear` / `Fp8Experts` where the checkpoint keeps e4m3 weights."""
    with torch.device("meta"):
        model = DsaForCausalLM(config, indexer_mode=indexer_mode)
        layers = {int(m.group(1)) for k in ckpt.tensors if (m := _LAYER.match(k))}
        for i in range(max(layers, default=-1) - config.num_hidden_layers + 1):
            prefix = mtp_prefix(config, i)
            model.mtp.append(
                MtpLayer(
                    config,
                    config.num_hidden_layers + i,
                    sparse=f"{prefix}mlp.gate.weight" in ckpt,
                    indexer=f"{prefix}self_attn.indexer.wk.weight" in ckpt,
                    own_embed=False,  # shared with the model: `shared_copies`
                    own_head=False,
                )
            )
    if fp8_format is not None:
        _swap_in_fp8(model, ckpt, config, fp8_format.pow2_scales)
    return model


def shared_copies(config: DsaConfig, ckpt: CheckpointIndex) -> set[str]:
    """The MTP layers' copies of the embedding and the LM head, which the loader skips: the
    V3 paper shares both with the main model and the releases store the same values twice,
    so the model's own are used (`MtpLayer.embed` / `logits`), read once and held once
    (aliasing would still read or check the copies: two vocabulary-sized tensors per layer)."""
    ends = (".embed_tokens.weight", ".shared_head.head.weight")
    return {
        k
        for k in ckpt.tensors
        if (m := _LAYER.match(k))
        and int(m.group(1)) >= config.num_hidden_layers
        and k.endswith(ends)
    }


def _hf_name(config: DsaConfig, name: str) -> str:
    """The checkpoint name of parameter or module ``name`` (MTP layers: under
    ``model.layers.<L + i>.``; the rest as named)."""
    if name.startswith("mtp."):
        _, i, rest = name.split(".", 2)
        return mtp_prefix(config, int(i)) + rest
    return name


def _is_fp8(ckpt: CheckpointIndex, key: str) -> bool:
    info = ckpt.get(key)
    return info is not None and info.dtype == torch.float8_e4m3fn


def _swap_in_fp8(model: nn.Module, ckpt: CheckpointIndex, config: DsaConfig, pow2: bool) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            prefix = _hf_name(config, name) + ".experts"
            if _is_fp8(ckpt, f"{prefix}.0.gate_proj.weight") or _is_fp8(
                ckpt, f"{prefix}.gate_up_proj"
            ):
                h, i = config.hidden_size, config.moe_intermediate_size
                with torch.device("meta"):
                    module.fp8_experts = Fp8Experts(len(module.experts), h, i, pow2=pow2)
                module.experts = nn.ModuleList()
    for name, module in list(model.named_modules()):
        parent, _, attr = name.rpartition(".")
        kept = type(module) is nn.Linear and attr in _FP8_KEPT
        if kept and _is_fp8(ckpt, _hf_name(config, name) + ".weight"):
            setattr(model.get_submodule(parent), attr, Fp8Linear.like(module, pow2))


def _plan_reads(model: nn.Module, config: DsaConfig, ckpt: CheckpointIndex,
                full: dict[str, tuple[int, ...]], splits: dict[str, Any]) -> _Plan:  # fmt: skip
    plan = _Plan(ckpt, config)
    owners = {n: m for n, m in model.named_modules()}
    for name, _ in model.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        module = owners[mod_name]
        split = splits.get(name)
        if name in splits and split is None:  # a row-parallel bias on rank > 0: zeros
            key = plan.hf(name)
            plan.expect[key] = full[name]
            plan.pieces[name] = [_Piece(key, (), zero=True)]
            continue
        if isinstance(module, Fp8Experts):
            plan.experts(name, module, attr, full[name], split)
        elif isinstance(module, Fp8Linear) and attr != "bias":
            plan.add(name, plan.hf(name), full[name], split, dequant=False)
        else:
            plan.plain(name, full[name], split)
    return plan


def _validate(plan: _Plan, path: Path, config: DsaConfig) -> None:
    ckpt = plan.ckpt
    if plan.missing:
        more = f" (and {len(plan.missing) - 5} more)" if len(plan.missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(plan.missing[:5])}{more}")
    used = set(plan.expect) | plan.skipped
    for key, info in ckpt.tensors.items():
        if info.dtype == torch.float8_e4m3fn:
            skey = _scale_key(key)
            if skey not in ckpt:
                raise CheckpointError(f"{key} is fp8 but {skey} is missing")
            _check_scale_shape(skey, info.shape, ckpt[skey].shape)
            used.add(skey)
        elif key.endswith("_scale_inv"):
            base = ckpt.get(key.removesuffix("_scale_inv"))
            if base is None:
                raise CheckpointError(f"scale tensors without a weight: {key}")
            if base.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{key.removesuffix('_scale_inv')} has a {key} but is "
                                      f"{base.dtype}, not fp8")  # fmt: skip
    for key, want in plan.expect.items():
        got = ckpt[key].shape
        if got != want:
            raise CheckpointError(
                f"{path}: tensor {key} has shape {got}, the config implies {want}"
            )
    unexpected = [k for k in ckpt.tensors if k not in used and not _IGNORED.search(k)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])}{more} for a "
            f"{config.arch} model with {config.num_hidden_layers} layers"
        )


def _fp32_param_names(model: nn.Module) -> set[str]:
    """Router weights and the indexer's head weights stay fp32 (transformers); fp8 scales."""
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, Router):
            names.update(f"{mod_name}.{p}" for p, _ in module.named_parameters())
        elif isinstance(module, Indexer):
            names.add(f"{mod_name}.weights_proj.weight")
        elif isinstance(module, Fp8Linear):
            names.add(f"{mod_name}.weight_scale_inv")
        elif isinstance(module, Fp8Experts):
            names.update(f"{mod_name}.{p}_scale" for p in ("gate", "up", "down"))
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype the loader gives each parameter of ``model`` (its meta skeleton): e4m3
    weights stay e4m3, fp8 scales, router and indexer head weights fp32, the rest ``dtype``."""
    fp32 = _fp32_param_names(model)
    return {
        name: fp8.FP8_DTYPE if p.dtype == fp8.FP8_DTYPE else torch.float32 if name in fp32
        else dtype
        for name, p in model.named_parameters()
    }  # fmt: skip


def shard_weight_bytes(
    config: DsaConfig,
    ckpt: CheckpointIndex,
    *,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
    world: int = 1,
    fp8_format: fp8.Fp8Format | None = None,
) -> int:
    """The bytes of weights `load_dsa_model` allocates on rank ``rank`` of ``world`` for
    checkpoint ``ckpt`` (its headers only), from the sharded meta skeleton: what
    ``hisparse plan`` must count."""
    from hisparse.parallel.shard import shard_dsa

    model = build_dsa_model(config, ckpt, fp8_format=fp8_format)
    if world > 1:
        shard_dsa(model, rank, world)
    dtypes = param_dtypes(model, dtype)
    return sum(p.numel() * dtypes[n].itemsize for n, p in model.named_parameters())


def _fill(dest: torch.Tensor, piece: _Piece, reader: SliceReader) -> None:
    """Copy one piece's checkpoint slice into ``dest`` (dequantizing 128 rows at a time)."""
    target = dest[piece.dst] if piece.dst else dest
    if piece.zero:
        dest.zero_()
        return
    src = reader.read(piece.key, piece.src)
    if piece.scale is None:
        target.copy_(src)
        return
    rows, cols = piece.src[-2], piece.src[-1]
    lead = piece.src[:-2]
    s_idx = (*lead, slice(rows.start // fp8.BLOCK, fp8.cdiv(rows.stop, fp8.BLOCK)),
             slice(cols.start // fp8.BLOCK, fp8.cdiv(cols.stop, fp8.BLOCK)))  # fmt: skip
    scale = reader.read(piece.scale, s_idx).float()
    w = src.reshape(-1, *src.shape[-2:])
    s = scale.reshape(-1, *scale.shape[-2:])
    out = target.reshape(-1, *target.shape[-2:])
    r_off, c_off = rows.start % fp8.BLOCK, cols.start % fp8.BLOCK
    step = fp8.BLOCK
    for b in range(w.shape[0]):
        for r in range(0, w.shape[1], step):
            tile0 = (r_off + r) // fp8.BLOCK
            chunk = w[b, r : r + step]
            deq = fp8.dequantize(chunk, s[b, tile0:], (r_off + r) % fp8.BLOCK, c_off)
            out[b, r : r + step].copy_(deq)


def load_dsa_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    indexer_mode: str = "exact",
    rank: int = 0,
    world: int = 1,
    tp: Any = None,
    fp8_weights: str = "keep",
    experts: tuple[int, int] | None = None,
) -> DsaForCausalLM:
    """Build the model of ``path/config.json`` and load rank ``rank``'s shard of ``world``
    (``tp``: its `TPGroup`, for the collectives of a running rank) onto ``device``.

    ``dtype`` is the compute dtype of every weight except fp8 ones (kept e4m3, their scales
    fp32), the router and the indexer's ``weights_proj`` (fp32 as in transformers). Tests use
    ``torch.float32``. ``fp8_weights="dequantize"`` turns every fp8 weight into ``dtype``.
    ``experts``: ``(first, count)``, the routed experts this rank keeps (expert parallelism:
    `keep_experts`)."""
    from hisparse.parallel.shard import shard_dsa

    if fp8_weights not in FP8_MODES:
        raise ValueError(f"fp8_weights={fp8_weights!r}: expected one of {FP8_MODES}")
    path, device = Path(path), torch.device(device)
    config = DsaConfig.from_pretrained(path)
    try:
        fmt = fp8.Fp8Format.of_checkpoint(path)
    except fp8.Fp8FormatError as err:
        raise CheckpointError(f"{path}: {err}") from None
    ckpt = CheckpointIndex(path)
    if fmt is None and any(t.dtype == torch.float8_e4m3fn for t in ckpt.tensors.values()):
        fmt = fp8.Fp8Format()  # e4m3 tensors without a quantization_config: DeepSeek's format
    keep = fmt if fp8_weights == "keep" else None
    model = build_dsa_model(config, ckpt, indexer_mode=indexer_mode, fp8_format=keep)
    skipped = keep_experts(model, ckpt, config, *experts) if experts is not None else set()
    skipped |= shared_copies(config, ckpt)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    splits = shard_dsa(model, rank, world, tp) if world > 1 else {}
    plan = _plan_reads(model, config, ckpt, full, splits)
    plan.skipped = skipped
    _validate(plan, path, config)
    dtypes = param_dtypes(model, dtype)
    total = sum(_piece_bytes(p, ckpt) for ps in plan.pieces.values() for p in ps)
    console = progress_console() if rank == 0 else None
    progress = LoadProgress(total, console)
    state: dict[str, torch.Tensor] = {}
    try:
        with SliceReader(ckpt, progress) as reader:
            for name, p in model.named_parameters():
                dest = torch.empty(p.shape, dtype=dtypes[name], device=device)
                split = splits.get(name)
                if split is not None and split[1] + split[2] > full[name][split[0]]:
                    dest.zero_()  # vocabulary padding rows past the checkpoint's
                for piece in plan.pieces[name]:
                    try:
                        _fill(dest, piece, reader)
                    except (RuntimeError, ValueError) as err:
                        raise CheckpointError(f"{path}: reading {piece.key}: {err}") from err
                state[name] = dest
    finally:
        progress.close()
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(config).to(device)
    model.load_stats = {"bytes_read": progress.done, "seconds": progress.elapsed}
    return model.eval()


def keep_experts(
    model: nn.Module, ckpt: CheckpointIndex, config: DsaConfig, first: int, count: int
) -> set[str]:
    """On the meta model: keep routed experts ``[first, first + count)`` of every MoE layer
    (the others are another rank's: never read here); returns the checkpoint keys of the
    experts dropped. fp8 experts stored fused (transformers' ``gate_up_proj``) are read whole
    and split after the load (`hisparse.parallel.expert.ExpertParallel`)."""
    kept = range(first, first + count)
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        ex = moe.fp8_experts
        if ex is not None and f"{_hf_name(config, name)}.experts.0.gate_proj.weight" in ckpt:
            for attr, p in list(ex.named_parameters(recurse=False)):
                setattr(ex, attr, nn.Parameter(p.data[first : first + count], requires_grad=False))
            ex.n_experts, ex.first_expert = count, first
        for e in range(len(moe.experts)):
            if e not in kept:
                moe.experts[e] = nn.Module()  # no parameters: another rank's expert
    return {k for k in ckpt.tensors if (m := _EXPERT.search(k)) and int(m.group(1)) not in kept}


def _piece_bytes(piece: _Piece, ckpt: CheckpointIndex) -> int:
    if piece.zero:
        return 0
    info = ckpt[piece.key]
    n = 1
    for d, ix in zip(info.shape, list(piece.src) + [slice(None)] * len(info.shape), strict=False):
        if isinstance(ix, int):
            continue
        start, stop, _ = ix.indices(d)
        n *= max(0, stop - start)
    return n * info.dtype.itemsize
