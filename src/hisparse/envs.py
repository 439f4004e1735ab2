"""Every ``HISPARSE_*`` environment variable the library reads, in one registry: its name,
type, default and what it does (the README's table lists the same). Nothing else in hisparse
reads ``os.environ`` for them; code asks `value`.

A variable's text is parsed and checked once per distinct value: `value` looks the text up
(one dictionary read) and returns the parsed value it cached for it, so an environment changed
at run time (tests) takes effect and a wrong value fails on first use, naming the choices.
No torch here: the scheduler's imports stay torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class EnvVar:
    """One variable: ``parse(text)`` gives its value (raising `ValueError` that names it)."""

    name: str
    kind: str
    default: str
    doc: str
    parse: Callable[[str], Any]


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            listed = ", ".join(repr(c) for c in choices)
            raise ValueError(f"{name}={text!r}: use one of {listed}.")
        return text

    return parse


def _switch(name: str) -> Callable[[str], bool]:
    """``1`` on, ``0`` off."""
    return lambda text: _choice(name, ("0", "1"))(text) == "1"


def _seconds(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} must be a number of seconds") from None
        if not value > 0:
            raise ValueError(f"{name}={text!r} must be positive")
        return value

    return parse


def _var(name: str, kind: str, default: str, doc: str, parse: Callable[[str], Any]) -> EnvVar:
    return EnvVar(name, kind, default, doc, parse)


def _backend_var(name: str, what: str) -> EnvVar:
    return _var(name, "auto / reference / triton", "auto",
                f"{what}: ``auto`` Triton on CUDA and the PyTorch reference elsewhere; the "
                "others force one (A/B runs, CPU tests under TRITON_INTERPRET=1)",
                _choice(name, BACKENDS))  # fmt: skip


REGISTRY: dict[str, EnvVar] = {
    v.name: v
    for v in (
        _backend_var("HISPARSE_ATTENTION", "sparse attention (MLA, GQA, DeepSeek-V4) kernels"),
        _backend_var("HISPARSE_INDEXER", "the DSA lightning indexer's scores"),
        _backend_var("HISPARSE_GQA_INDEXER", "the GQA models' indexers"),
        _backend_var("HISPARSE_TOPK", "the indexer's top-k selection"),
        _backend_var("HISPARSE_FUSED", "the fused layer ops (norms, rotary, row writes, MoE)"),
        _var(
            "HISPARSE_OPS",
            "auto / reference / cpu / triton",
            "auto",
            "the HiSparse data-plane ops (resolve, gathers, mirror): ``auto`` Triton on "
            "CUDA, the numba CPU backend on the CPU",
            _choice("HISPARSE_OPS", ("auto", "reference", "cpu", "triton")),
        ),
        _var(
            "HISPARSE_MLA_KERNEL",
            "auto / triton",
            "auto",
            "sparse MLA decode: ``auto`` takes the Gluon kernel on Hopper where it applies",
            _choice("HISPARSE_MLA_KERNEL", ("auto", "triton")),
        ),
        _var(
            "HISPARSE_INDEXER_KERNEL",
            "auto / triton",
            "auto",
            "indexer scores: ``auto`` takes the Gluon TMA kernel on Hopper where it applies",
            _choice("HISPARSE_INDEXER_KERNEL", ("auto", "triton")),
        ),
        _var(
            "HISPARSE_FP8_GEMM",
            "auto / scaled_mm / triton / reference",
            "auto",
            "the block-scaled fp8 GEMM of fp8 checkpoints",
            _choice("HISPARSE_FP8_GEMM", ("auto", "scaled_mm", "triton", "reference")),
        ),
        _var(
            "HISPARSE_FP8_MOE",
            "auto / triton / reference",
            "auto",
            "the grouped fp8 GEMM of the routed experts",
            _choice("HISPARSE_FP8_MOE", ("auto", "triton", "reference")),
        ),
        _var(
            "HISPARSE_PDL",
            "0 / 1",
            "1",
            "programmatic dependent launches of the small Triton kernels on Hopper",
            _switch("HISPARSE_PDL"),
        ),
        _var(
            "HISPARSE_CPU_JIT",
            "0 / 1",
            "1",
            "the numba-compiled CPU kernels (``0``: numpy/torch everywhere)",
            _switch("HISPARSE_CPU_JIT"),
        ),
        _var(
            "HISPARSE_CPU_FAST",
            "0 / 1",
            "1",
            "the Llama batch-1 CPU decode path (``0``: the general layer loop, A/B checks)",
            _switch("HISPARSE_CPU_FAST"),
        ),
        _var(
            "HISPARSE_POISON",
            "0 / 1",
            "0",
            "fill CPU KV pools with 0xFF (NaN) at start-up, as GPU pools always are (tests)",
            _switch("HISPARSE_POISON"),
        ),
        _var(
            "HISPARSE_OFFLOAD",
            "always / under_pressure",
            "",
            "the offload policy where `HiSparseConfig.offload` is unset (default "
            "``under_pressure``)",
            _choice("HISPARSE_OFFLOAD", ("always", "under_pressure")),
        ),
        _var(
            "HISPARSE_TP_TIMEOUT",
            "seconds",
            "",
            "how long a tensor-parallel rank waits for the others before the engine fails",
            _seconds("HISPARSE_TP_TIMEOUT"),
        ),
        _var(
            "HISPARSE_HYPOTHESIS",
            "fixed / explore",
            "fixed",
            "the test suite's property tests: the same examples every run, or fresh ones",
            _choice("HISPARSE_HYPOTHESIS", ("fixed", "explore")),
        ),
    )
}

_parsed: dict[tuple[str, str], Any] = {}


def value(name: str) -> Any:
    """The parsed value of ``name`` (its default where unset or empty); ``None`` for a
    variable without a default that is unset."""
    var = REGISTRY[name]
    text = os.environ.get(name) or var.default
    if not text:
        return None
    key = (name, text)
    if key not in _parsed:
        _parsed[key] = var.parse(text)
    return _parsed[key]


def backend(name: str, device_type: str) -> str:
    """``triton`` or ``reference`` for tensors on a device of ``device_type``, as the
    backend variable ``name`` decides."""
    choice = value(name)
    if choice == "auto":
        return "triton" if device_type == "cuda" else "reference"
    return choice


def table() -> str:
    """The registry as a Markdown table (the README's)."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for v in REGISTRY.values():
        rows.append(f"| `{v.name}` | {v.kind} | {v.default or '(unset)'} | {v.doc} |")
    return "\n".join(rows)
