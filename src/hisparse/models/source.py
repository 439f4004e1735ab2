"""Which model a user named: one resolver for `hisparse.LLM` and every ``hisparse`` subcommand.

A model is named the same way everywhere: a preset of the releases' shapes (``deepseek-v3.2``,
``glm-5``; case-insensitive), the bundled ``smollm2``, a Llama ``.gguf`` file, a DSA checkpoint
folder, or that folder's ``config.json``. `resolve_model_source` says what was named (or why
nothing was); each command then says what it cannot do with that kind of model and why
(`require_weights`, `require_dsa`), instead of failing later on a file it cannot find.
This module imports no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hisparse.validation import HiSparseConfigError, HiSparseTypeError

#: preset name -> the releases' ``model_type`` (shapes only: no weights ship with hisparse)
PRESET_MODEL_TYPES = {"deepseek-v3.2": "deepseek_v32", "glm-5": "glm_moe_dsa"}
#: names of the bundled SmolLM2-135M-Instruct (`hisparse.models.smollm2`)
SMOLLM2_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
#: what a model argument may be, for messages
ACCEPTED = (
    f"a preset ({', '.join(PRESET_MODEL_TYPES)}), 'smollm2' (bundled), a Llama .gguf file, "
    "a DSA checkpoint folder (config.json + *.safetensors) or its config.json"
)
_MAKE_TINY = "hisparse make-tiny OUT --arch deepseek_v32 (a small random checkpoint)"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model argument. ``kind``: ``"preset"``, ``"gguf"`` or ``"checkpoint"``;
    ``path``: the .gguf file or the checkpoint folder (``None`` for a preset)."""

    given: str
    kind: str
    name: str
    path: Path | None = None

    @property
    def config_json(self) -> Path | None:
        return self.path / "config.json" if self.kind == "checkpoint" and self.path else None

    @property
    def is_dsa(self) -> bool:
        return self.kind in ("preset", "checkpoint")


def resolve_model_source(model: Any, *, name: str = "model") -> ModelSource:
    """``model`` as a `ModelSource`; ``name`` is how messages call the argument (``--model``,
    ``LLM.model``). A missing path, a folder without config.json or an unreadable config.json
    is a `HiSparseConfigError` naming the file and what would work."""
    if not isinstance(model, str | os.PathLike):
        raise HiSparseTypeError(
            f"{name}={model!r} must be a string or a path: {ACCEPTED}.", field="LLM.model",
            value=model,
        )  # fmt: skip
    text = os.fspath(model)
    key = text.strip().lower()
    if key in PRESET_MODEL_TYPES:
        return ModelSource(text, "preset", key)
    if key in SMOLLM2_NAMES:
        from hisparse.models.smollm2 import smollm2_gguf_path

        return ModelSource(text, "gguf", "smollm2", smollm2_gguf_path())
    path = Path(text).expanduser()
    if not path.exists():
        raise HiSparseConfigError(
            f"{name} {text!r}: no such file or folder, and not a preset name. Pass {ACCEPTED}."
        )
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(text, "gguf", path.stem, path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    elif path.is_file():
        raise HiSparseConfigError(
            f"{name} {text!r} is a file but neither a .gguf file nor a config.json. Pass "
            f"{ACCEPTED}."
        )
    config = path / "config.json"
    if not config.is_file():
        raise HiSparseConfigError(
            f"{name} {text!r}: this folder has no config.json, so it is not a checkpoint. "
            f"Pass {ACCEPTED}."
        )
    read_config_json(config)
    return ModelSource(text, "checkpoint", path.name or text, path)


def read_config_json(path: Path) -> dict[str, Any]:
    """A checkpoint's config.json as a dict; a file that is not one JSON object is a
    `HiSparseConfigError` naming the file, the line and the column."""
    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise HiSparseConfigError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "fix or replace the checkpoint's config.json"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise HiSparseConfigError(f"cannot read {path}: {err}") from None
    if not isinstance(cfg, dict):
        raise HiSparseConfigError(f"{path} does not hold a JSON object (a checkpoint config).")
    return cfg


def require_weights(src: ModelSource, command: str, name: str = "model") -> Path:
    """The weights' path, or why ``command`` cannot run a preset (shapes only)."""
    if src.kind == "preset" or src.path is None:
        raise HiSparseConfigError(
            f"{name} {src.given!r} is a preset of the released model's shapes, without weights "
            f"(hisparse plan and simulate use presets); {command} needs weights: pass a "
            f"checkpoint folder of the model, or make one with {_MAKE_TINY}."
        )
    return src.path


def require_dsa(src: ModelSource, command: str, name: str = "--model") -> None:
    """Refuse a Llama (GQA) model where ``command`` models only DSA layers, and say why."""
    if not src.is_dsa:
        raise HiSparseConfigError(
            f"{name} {src.given!r} is a Llama (GQA) model; {command} models DeepSeek-V3.2 / "
            "GLM-5 (DSA) layers only: pass a preset (deepseek-v3.2, glm-5) or a DSA "
            f"checkpoint folder (e.g. made by {_MAKE_TINY}); run a GQA model with hisparse "
            "generate or serve."
        )


def model_context(src: ModelSource) -> int | None:
    """The model's context limit (``max_position_embeddings``) without loading weights; None
    when its config does not say."""
    if src.kind == "gguf":
        return None
    from hisparse.models.dsa_config import DsaConfig

    if src.kind == "preset":
        model_type = PRESET_MODEL_TYPES[src.name]
        return DsaConfig.from_dict({"model_type": model_type}).max_position_embeddings
    cfg = read_config_json(src.config_json)  # type: ignore[arg-type]
    value = cfg.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None
