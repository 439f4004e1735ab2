"""How close a real prefill runs to the GPU's matmul rate (``hisparse bench --prefill model``).

The FLOP count of a prompt of ``n`` tokens of a DSA model, stated so a reader can redo it:

* every linear layer a token passes through, ``2 * in * out`` per token (routed experts
  counted at ``num_experts_per_tok / n_routed_experts`` of their weights, the LM head not at
  all: only the last token of a prompt reaches it);
* the lightning indexer's scores, ``2 * index_n_heads * index_head_dim`` per (query, earlier
  key) pair, causal: ``n (n + 1) / 2`` pairs per indexer layer;
* sparse MLA in the absorbed form, per token and head: the query's absorption into the latent
  (``2 * qk_nope * kv_lora_rank``), scores and values over ``min(top_k, position + 1)`` rows
  (``2 * (kv_lora_rank + qk_rope)`` and ``2 * kv_lora_rank`` each), and the output's
  un-absorption (``2 * kv_lora_rank * v_head_dim``).

The rate it is compared with is measured in the same process on the model's own linear-layer
shapes at the step's token count (bf16 GEMMs through ``F.linear``), so "MFU" here means the
fraction of the matmul rate this GPU reaches on these shapes, not of a datasheet figure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _linear_shapes(model: torch.nn.Module) -> list[tuple[int, int, float]]:
    """``(in, out, tokens fraction)`` of every linear layer a prompt token runs through."""
    from hisparse.models.deepseek_v32 import MoE

    cfg = model.config  # type: ignore[attr-defined]
    routed = cfg.num_experts_per_tok / max(cfg.n_routed_experts, 1)
    shapes = []
    for layer in model.model.layers:  # type: ignore[attr-defined]
        for name, mod in layer.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            frac = routed if isinstance(layer.mlp, MoE) and ".experts." in f".{name}" else 1.0
            shapes.append((mod.in_features, mod.out_features, frac))
    return shapes


def prefill_flops(model: torch.nn.Module, num_tokens: int, top_k: int) -> float:
    """FLOPs of a ``num_tokens`` prompt (the count of this module's docstring)."""
    cfg = model.config  # type: ignore[attr-defined]
    n = num_tokens
    linear = sum(2 * i * o * f for i, o, f in _linear_shapes(model)) * n
    pairs = n * (n + 1) / 2
    indexer = 2 * cfg.index_n_heads * cfg.index_head_dim * pairs * sum(cfg.indexer_full)
    c, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    k = min(top_k, n)
    rows = k * (k + 1) / 2 + (n - k) * k  # sum over positions of min(top_k, pos + 1)
    per_head = n * 2 * c * (cfg.qk_nope_head_dim + cfg.v_head_dim) + rows * 2 * (2 * c + rope)
    attention = per_head * cfg.num_attention_heads * cfg.num_hidden_layers
    return float(linear + indexer + attention)


def measured_gemm_rate(model: torch.nn.Module, num_tokens: int, repeats: int = 5) -> float | None:
    """FLOP/s of the model's linear-layer GEMMs at ``num_tokens`` rows (CUDA only): each
    distinct shape timed with CUDA events (median of ``repeats``), weighted by how often the
    model runs it."""
    weight = next(model.parameters())
    if weight.device.type != "cuda":
        return None
    counts: dict[tuple[int, int], float] = {}
    for i, o, f in _linear_shapes(model):
        counts[(i, o)] = counts.get((i, o), 0.0) + f
    flops = seconds = 0.0
    for (i, o), times in counts.items():
        m = num_tokens
        x = torch.randn(m, i, device=weight.device, dtype=weight.dtype)
        w = torch.randn(o, i, device=weight.device, dtype=weight.dtype)
        F.linear(x, w)  # warm-up (handle creation, kernel choice)
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            F.linear(x, w)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        samples.sort()
        flops += 2 * m * i * o * times
        seconds += samples[len(samples) // 2] * times
        del x, w
    return flops / seconds if seconds > 0 else None
