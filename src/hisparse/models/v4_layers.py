"""DeepSeek-V4's building blocks outside attention: norms, rotary tables, hyper-connections and
the hash- or score-routed MoE.

Module and parameter names are the release's (``attn_norm``, ``hc_attn_fn``, ``ffn.gate.tid2eid``,
``experts.{e}.w1`` ...), so a checkpoint's tensors load 1:1; each forward keeps transformers'
order of operations (``DeepseekV4*``), which the CPU tests compare against in fp32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.models.dsa_config import RopeConfig
from hisparse.models.layers import rope_interleaved
from hisparse.models.v4_config import V4Config


class V4RMSNorm(nn.Module):
    """RMS norm in fp32, scaled by an fp32 weight, then cast (V4's order, unlike Llama's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight (V4's per-head query norm and hyper-connection input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Rotary(nn.Module):
    """cos/sin of one RoPE kind (``main`` or ``compress``) at given positions: one angle per
    interleaved pair of the trailing ``qk_rope_head_dim`` channels."""

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if meta else contextlib.nullcontext():
            inv_freq, factor = rope.inv_freq_and_factor(dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.factor = factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x [N, ..., D]``
    (V4 lays each head out as ``[nope | rope]``), computed in fp32."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = rope_interleaved(rope.float(), cos.float(), sin.float()).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)


# ---------------------------------------------------------------------------------------------
# Hyper-connections
# ---------------------------------------------------------------------------------------------
def hc_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    config: V4Config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(post [N, n], comb [N, n, n], collapsed [N, H])`` of the ``n`` residual streams
    ``streams [N, n, H]``: pre and post gates from sigmoids, the stream-mixing matrix made
    doubly stochastic by Sinkhorn-Knopp iterations, the block's input collapsed with pre."""
    n = config.hc_mult
    eps = config.hc_eps
    flat = unweighted_rms_norm(streams.flatten(1).float(), config.rms_norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: its output ``out [N, H]`` spread by ``post`` plus the old
    streams mixed by ``comb`` (read transposed: stream ``k`` takes ``Σ_j comb[j, k] · s_j``)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            config: V4Config) -> torch.Tensor:  # fmt: skip
    """The final collapse of the streams ``[N, n, H]`` to ``[N, H]`` (before the last norm)."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), config.rms_norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + config.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------
class Expert(nn.Module):
    """SwiGLU with V4's clamps: gate at most ``limit``, up within ``±limit`` (w1 gate, w3 up,
    w2 down, the release's names)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


_SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


class Gate(nn.Module):
    """The router: scores from ``scoring_func``; experts from a frozen token-id table
    (``tid2eid``, hash layers) or the top-k of the bias-corrected scores; the chosen scores
    renormalized and scaled."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size))
        self.hashed = hashed
        if hashed:
            tid2eid = torch.zeros(config.vocab_size, config.num_experts_per_tok, dtype=torch.long)
            self.register_buffer("tid2eid", tid2eid)
        else:
            self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.score = _SCORES[config.scoring_func]
        self.scaling = config.routed_scaling_factor

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(weights [N, k], expert ids [N, k])``."""
        scores = self.score(F.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class V4MoE(nn.Module):
    """Routed experts (ascending expert order, as transformers adds them) plus one shared."""

    def __init__(self, config: V4Config, layer: int) -> None:
        super().__init__()
        h, i, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, config.mlp_layer_types[layer] == "hash_moe")
        self.experts = nn.ModuleList(Expert(h, i, lim) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(h, i, lim)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, *, sync_free: bool = False
    ) -> torch.Tensor:
        """``sync_free``: every expert on every row, a row's term kept where its router chose
        the expert (no host read: fixed shapes for CUDA graphs; the same terms in the same
        order, only the matmuls' row counts differ)."""
        weights, ids = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        if sync_free:
            for e, expert in enumerate(self.experts):
                chosen = ids == e  # [N, k]: at most one True per row
                w = torch.where(chosen, weights, 0.0).sum(-1, keepdim=True)
                y = (expert(x) * w).to(out.dtype)
                out = out + torch.where(chosen.any(-1, keepdim=True), y, 0.0)
            return out + self.shared_experts(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out + self.shared_experts(x)
