"""Load a Llama-architecture GGUF file (llama.cpp's format) into `LlamaForCausalLM`.

Read with the ``gguf`` package (``GGUFReader``, memory-mapped); every tensor is dequantized
with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants, …) to fp32 and
then cast to the requested dtype. The model shape comes from the ``llama.*`` metadata.

Two things llama.cpp's converter changes, undone here:

- Q and K weight rows are permuted per head from the half-split RoPE layout (HF's
  ``rotate_half``: pairs ``(i, i + D/2)``) into llama.cpp's interleaved layout (pairs
  ``(2i, 2i + 1)``). `unpermute_qk` restores the HF order, so the model applies the same
  rotate_half RoPE as transformers and its cached K rows match transformers' keys.
- No ``output.weight`` means the LM head is tied to the token embedding.

A missing, unexpected or mis-shaped tensor, or a tensor type ``gguf`` cannot dequantize,
raises `GgufError` naming the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hisparse.models.llama import LlamaConfig, LlamaForCausalLM, Rotary
from hisparse.models.loader import CheckpointError

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
#: GGUF tensor name (per block) -> transformers name under ``model.layers.N.``.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GgufError(CheckpointError):
    """A GGUF file this loader cannot use; the message names the key or tensor."""


@dataclass
class GgufFile:
    """The parsed metadata of a GGUF file and its (still quantized) tensors by name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def _field_value(field: Any) -> Any:
    """A metadata field as plain Python (``str``, ``int``, ``float``, ``bool`` or a list)."""
    return field.contents()


def read_gguf(path: str | Path, *, keys: tuple[str, ...] | None = None) -> GgufFile:
    """Open ``path`` (memory-mapped); parse every metadata field (or only ``keys``)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise GgufError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise GgufError(f"{path} is not a readable GGUF file: {e}") from e
    metadata = {
        name: _field_value(field)
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and (keys is None or name in keys)
    }
    return GgufFile(path=path, metadata=metadata, tensors={t.name: t for t in reader.tensors})


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GgufError(f"GGUF metadata key {key!r} is missing")
    return meta[key]


def llama_config_from_gguf(gf: GgufFile) -> LlamaConfig:
    """`LlamaConfig` from the ``llama.*`` and ``tokenizer.ggml.*`` metadata."""
    meta, arch = gf.metadata, gf.architecture
    if arch != "llama":
        raise GgufError(f"{gf.path.name}: general.architecture is {arch!r}; only 'llama' loads")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise GgufError(f"llama.rope.scaling.type {scaling!r} is not supported")
    hidden = int(_require(meta, "llama.embedding_length"))
    heads = int(_require(meta, "llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GgufError(f"llama.rope.dimension_count {rope_dims} != head dim {head_dim}")
    if "llama.vocab_size" in meta:
        vocab = int(meta["llama.vocab_size"])
    elif "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        vocab = int(gf.tensors["token_embd.weight"].shape[1])
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_require(meta, "llama.feed_forward_length")),
        num_hidden_layers=int(_require(meta, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta.get("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
    )


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as fp32 ``[rows, cols]`` (GGUF lists dims innermost first)."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GgufError(
            f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized: {e}"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    return torch.from_numpy(arr.copy())


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head Q/K row permutation (interleaved -> half-split RoPE order).

    llama.cpp wrote ``w.reshape(n, 2, D/2, ...).swapaxes(1, 2)``; the inverse swaps back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    """The GGUF name of a transformers weight name (for error messages)."""
    for g, h in _TOP_NAMES.items():
        if h == hf_name:
            return g
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if m:
        for g, h in _BLOCK_NAMES.items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}"
    return hf_name


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def load_llama_gguf(
    path: str | Path | GgufFile,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    indexer: Any = None,
) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` with the weights of the GGUF file at ``path``.

    ``path`` may be an already opened `GgufFile` (opening parses every metadata string, seconds
    for SmolLM2's vocabulary; share it with `GgufTokenizer.from_gguf`). ``indexer``: a
    `GqaIndexerConfig` (default: dense attention, ``top_k=None``).
    """
    gf = path if isinstance(path, GgufFile) else read_gguf(path)
    config = llama_config_from_gguf(gf)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, indexer)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in gf.tensors.items():
        if name == "rope_freqs.weight":
            raise GgufError(f"tensor {name}: per-frequency RoPE scaling (Llama 3) is not supported")
        hf = _hf_name(name)
        if hf is None or hf not in expected:
            raise GgufError(f"unexpected tensor {name} in {gf.path.name}")
        w = dequantize_tensor(tensor)
        if name.endswith("attn_q.weight"):
            w = unpermute_qk(w, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = unpermute_qk(w, config.num_key_value_heads)
        if tuple(w.shape) != tuple(expected[hf]):
            raise GgufError(
                f"tensor {name} ({hf}) has shape {tuple(w.shape)}; the metadata implies "
                f"{tuple(expected[hf])}"
            )
        state[hf] = w.to(dtype)
    missing = sorted(_gguf_name(k) for k in set(expected) - set(state))
    if missing:
        raise GgufError(f"tensor(s) missing from {gf.path.name}: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers were created on the meta device: make real ones.
    model.rotary = Rotary(config)
    for layer in model.model.layers:
        layer.self_attn.index_dims = torch.zeros(0, dtype=torch.long)
    model = model.to(device).eval()
    model.prepare_indexer()
    return model
