"""The flags every ``hisparse`` subcommand shares: one name, one help text, one default and
its choices per setting, registered from here so that ``generate``, ``serve``, ``bench``,
``plan`` and ``simulate`` cannot drift apart.

Names follow vLLM where the concept is vLLM's (``--max-num-batched-tokens``,
``--max-model-len``, ``--max-num-seqs``, ``--gpu-memory-utilization``); HiSparse's own knobs
carry names that cannot be read as sampling settings (``--sparse-top-k``,
``--hot-buffer-rows``). Older names stay accepted as hidden aliases (`ALIASES`) that print
one warning per process naming the new flag. An error about a value names the flag the user
typed (`typed_flag`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hisparse import defaults
from hisparse.config import OFFLOAD_POLICIES

#: Old flag -> the flag that replaced it (accepted, with one warning per process).
ALIASES = {
    "--top-k": "--sparse-top-k",
    "--device-buffer-size": "--hot-buffer-rows",
    "--hot-buffer": "--hot-buffer-rows",
    "--max-batched-tokens": "--max-num-batched-tokens",
}
#: Why an alias was renamed, printed with its warning.
_WHY = {
    "--top-k": "sampling's top-k is SamplingParams.top_k / the server's top_k; this flag is "
    "HiSparse's attention budget",
}
_warned: set[str] = set()

#: API field (as `hisparse.validation` names it) -> the flag that sets it.
FIELD_FLAGS = {
    "HiSparseConfig.top_k": "--sparse-top-k",
    "HiSparseConfig.device_buffer_size": "--hot-buffer-rows",
    "HiSparseConfig.host_pool_gib": "--host-pool-gib",
    "HiSparseConfig.offload": "--offload",
    "HiSparseConfig.block_size": "--block-size",
    "LLM.gpu_memory_gib": "--gpu-memory-gib",
    "LLM.gpu_memory_utilization": "--gpu-memory-utilization",
    "LLM.max_model_len": "--max-model-len",
    "LLM.max_num_seqs": "--max-num-seqs",
    "LLM.max_num_batched_tokens": "--max-num-batched-tokens",
    "LLM.kv_placement": "--kv-placement",
    "LLM.kv_format": "--kv-format",
    "LLM.dtype": "--dtype",
    "LLM.device": "--device",
    "LLM.model": "--model",
    "LLM.tensor_parallel_size": "--tensor-parallel-size",
    "LLM.data_parallel_size": "--data-parallel-size",
    "LLM.enable_expert_parallel": "--enable-expert-parallel",
    "LLM.enable_prefix_caching": "--enable-prefix-caching",
    "SamplingParams.max_tokens": "--max-tokens",
    "SamplingParams.temperature": "--temperature",
    "SamplingParams.seed": "--seed",
}

#: canonical flag -> argparse keywords; ``help`` ends with the default as the user sees it
OPTIONS: dict[str, dict[str, Any]] = {
    "--max-model-len": dict(
        type=int,
        default=None,
        help="most tokens of one request, prompt and output (default: the model's context limit)",
    ),
    "--max-num-seqs": dict(
        type=int,
        default=defaults.DEFAULT_MAX_NUM_SEQS,
        help="most requests running at once (default: %(default)s)",
    ),
    "--max-num-batched-tokens": dict(
        type=int,
        default=defaults.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="prompt tokens per engine step; sizes the HiSparse prefill staging area "
        "(default: %(default)s)",
    ),
    "--sparse-top-k": dict(
        type=int,
        default=None,
        help="HiSparse: KV rows each query token attends to, "
        "chosen by the indexer (not sampling's top-k) (default: the model's index_topk)",
    ),
    "--hot-buffer-rows": dict(
        type=int,
        default=None,
        help="HiSparse: GPU hot-buffer rows per request and layer "
        "(default: (max_query_len + 1) x --sparse-top-k)",
    ),
    "--host-pool-gib": dict(
        type=float,
        default=None,
        help="pinned host pool holding every KV row, GiB "
        "(default: what --max-num-seqs requests of --max-model-len need, at most half the "
        "host memory available)",
    ),
    "--offload": dict(
        # the choices in the metavar, not argparse's: `HiSparseConfig` names the flag and them
        metavar="{" + ",".join(OFFLOAD_POLICIES) + "}",
        default=None,
        help="under_pressure: pages stay on the GPU "
        "while there is room; always: only tail pages on the GPU (default: under_pressure, "
        "or $HISPARSE_OFFLOAD)",
    ),
    "--gpu-memory-gib": dict(
        type=float,
        default=None,
        help="GPU memory for the KV cache, GiB (default: 85%% of "
        "the GPU memory free after the weights load; 1 GiB on a CPU run)",
    ),
    "--gpu-memory-utilization": dict(
        type=float,
        default=None,
        help="instead of --gpu-memory-gib: the fraction of the GPU's "
        "whole memory the engine may take, weights and KV (vLLM's meaning; default: "
        "--gpu-memory-gib's rule)",
    ),
    "--kv-placement": dict(
        choices=("hisparse", "gpu"),
        default="hisparse",
        help="hisparse: KV in the host pool, "
        "a hot buffer on the GPU; gpu: every KV row on the GPU (default: %(default)s)",
    ),
    "--device": dict(default=None, help="cpu, cuda or cuda:N (default: cuda when available)"),
    "--dtype": dict(
        default="auto",
        help="model dtype: auto (bf16 on CUDA, fp32 on the CPU), float32, "
        "bfloat16, float16 (default: %(default)s)",
    ),
    "--tensor-parallel-size": dict(
        type=int,
        default=1,
        help="ranks to shard the model over, one GPU each; see the "
        "README for torchrun (default: %(default)s)",
    ),
    "--data-parallel-size": dict(
        type=int,
        default=1,
        help="data-parallel attention: ranks that each run their own requests with their own "
        "KV cache and host pool, one GPU each; not with --tensor-parallel-size "
        "(default: %(default)s)",
    ),
    "--block-size": dict(type=int, default=64, help="tokens per KV block (default: %(default)s)"),
    "--host": dict(
        default=defaults.DEFAULT_HOST,
        help="address to listen on (default: %(default)s, loopback only)",
    ),
    "--port": dict(
        type=int,
        default=defaults.DEFAULT_PORT,
        help="0: any free port, printed (default: %(default)s)",
    ),
}
#: the old names of each canonical flag
_OLD_NAMES: dict[str, list[str]] = {}
for _old, _new in ALIASES.items():
    _OLD_NAMES.setdefault(_new, []).append(_old)


class _Typed(argparse.Action):
    """Stores the value and remembers which spelling the user typed (``args.typed_flags``),
    warning once per process when it is an old alias."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        setattr(namespace, self.dest, values)
        typed = dict(getattr(namespace, "typed_flags", {}) or {})
        typed[self.dest] = option_string
        namespace.typed_flags = typed
        new = ALIASES.get(option_string or "")
        if new is not None and option_string not in _warned:
            _warned.add(option_string)  # type: ignore[arg-type]
            why = f" ({_WHY[option_string]})" if option_string in _WHY else ""
            print(
                f"warning: {option_string} is now {new}{why}; the old name will go away",
                file=sys.stderr,
            )


def add_option(parser: Any, flag: str, **overrides: Any) -> argparse.Action:
    """Add the shared ``flag`` (its old names as hidden aliases); ``overrides`` change its
    argparse keywords where a subcommand derives the default differently (say so in
    ``help``)."""
    kw = {**OPTIONS[flag], **overrides}
    dest = flag.lstrip("-").replace("-", "_")
    action = parser.add_argument(flag, dest=dest, action=_Typed, **kw)
    for old in _OLD_NAMES.get(flag, ()):
        hidden = {k: v for k, v in kw.items() if k not in ("help", "default", "required")}
        parser.add_argument(old, dest=dest, action=_Typed, help=argparse.SUPPRESS, **hidden)
    return action


def add_options(parser: Any, *flags: str) -> None:
    for flag in flags:
        add_option(parser, flag)


def typed_flag(args: argparse.Namespace, flag: str) -> str:
    """The spelling of ``flag`` the user typed (an old alias shows as typed)."""
    dest = flag.lstrip("-").replace("-", "_")
    return (getattr(args, "typed_flags", None) or {}).get(dest) or flag


def flag_for_field(args: argparse.Namespace, field: str | None) -> str | None:
    """The flag (as typed) that sets an API ``field``, if this subcommand has it."""
    flag = getattr(args, "flags", {}).get(field) or FIELD_FLAGS.get(field or "")
    if flag is None:
        return None
    dest = flag.lstrip("-").replace("-", "_")
    if not hasattr(args, dest) and flag not in getattr(args, "flags", {}).values():
        return None
    return typed_flag(args, flag)


def add_version(parser: argparse.ArgumentParser) -> None:
    from hisparse import __version__

    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")


def add_model_option(
    parser: Any, *, default: str | None = None, positional: bool = False, what: str = ""
) -> None:
    """``--model`` as every subcommand takes it (`hisparse.models.source`); ``positional``:
    also ``MODEL`` first, as ``vllm serve MODEL`` (`model_of` reconciles the two)."""
    from hisparse.models.source import ACCEPTED

    shown = f"default: {default}" if default is not None else "required"
    text = f"{ACCEPTED}{what} ({shown})"
    if positional:
        parser.add_argument(
            "model_pos", metavar="MODEL", nargs="?", default=None, help=f"the model: {text}"
        )
        parser.add_argument("--model", default=None, help=f"the same as MODEL ({shown})")
        parser.set_defaults(model_default=default)
    else:
        parser.add_argument("--model", default=default, required=default is None, help=text)


def model_of(args: argparse.Namespace) -> str:
    """The model of a subcommand with a positional ``MODEL``: that or ``--model`` (one of
    them, or both the same), else the default."""
    pos, flag = getattr(args, "model_pos", None), args.model
    if pos is not None and flag is not None and pos != flag:
        raise ValueError(
            f"two models named: {pos!r} (MODEL) and --model {flag!r}; give one of them"
        )
    return pos or flag or args.model_default
