"""``hisparse make-tiny``: write a small random DSA checkpoint (tests, GPU benchmarks).

No small trained DeepSeek-V3.2 / GLM-5 model exists, so tests and benchmarks build one with
`hisparse.models.tiny.make_tiny` (transformers initializes and saves it, so names, layout and
config.json are what a real checkpoint has). ``--preset tiny`` is a few hundred kB for CPU
tests; ``--preset v32-attention`` keeps the architecture's real attention and indexer
dimensions with 2 layers and a small FFN, for GPU benchmarks. ``--fp8`` writes the releases'
format instead (`hisparse.models.checkpoint_writer`: e4m3 weights with 128 x 128 ue8m0 tile
scales, DeepSeek's ``quantization_config``, the multi-token-prediction layer, a byte-level
tokenizer); ``--preset v32-shapes`` is DeepSeek-V3.2's real layer shapes with fewer experts and
layers (~3.4 GB with ``--fp8``), for GPU runs of the fp8 kernels. ``--arch deepseek_v4``
writes DeepSeek-V4 in the release's tensor names (`hisparse.models.v4_tiny`; ``--preset
v4-attention``: V4-Flash's attention shapes in 2 layers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hisparse.models.tiny import ARCHS, PRESETS, make_tiny, tiny_config_kwargs

#: ``--dtype`` names and the weight dtype each writes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: Files of a previous checkpoint that ``--force`` removes first, so a smaller new checkpoint
#: never sits next to stale shards or an index that still names them.
_CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
)

#: Exit status when the checkpoint cannot be built (e.g. transformers missing).
EXIT_FAILURE = 1


def add_make_tiny_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``make-tiny`` on the ``hisparse`` subcommand parser."""
    p = sub.add_parser(
        "make-tiny",
        help="write a small random DSA or DeepSeek-V4 checkpoint (tests, benchmarks)",
        description="Write a random DeepSeek-V3.2, GLM-5 or DeepSeek-V4 checkpoint "
        "(config.json + model.safetensors) built and saved by transformers.",
    )
    p.add_argument("out", metavar="OUT", type=Path, help="folder to write")
    p.add_argument("--arch", required=True, choices=ARCHS, help="model architecture")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="'tiny': small everything, index_topk 16 (CPU tests); 'v32-attention': the "
        "arch's real attention and indexer dims, 2 layers, small FFN; 'v32-shapes': "
        "DeepSeek-V3.2's real layer shapes, 16 experts, 3 layers + MTP; 'v4-attention' "
        "(deepseek_v4): V4-Flash's attention, 2 layers, small FFN (default: %(default)s)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="num_hidden_layers (default: the preset's)"
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="weight dtype (default: float32 for tiny, bfloat16 for v32-attention)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="the releases' fp8 block-scaled format (e4m3 + 128x128 ue8m0 scales, "
        "quantization_config) with the MTP layer and a byte-level tokenizer",
    )
    p.add_argument("--seed", type=int, default=0, help="torch seed (default: %(default)s)")
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty OUT, replacing a checkpoint"
    )
    p.set_defaults(handler=run_make_tiny)


def _check_out_dir(out: Path, force: bool) -> None:
    """Refuse a file, or a non-empty folder unless ``force``; with ``force`` drop old files."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ValueError(f"{out} is not empty; pass --force to overwrite the checkpoint there")
    for path in out.iterdir():
        if path.is_file() and (path.name in _CHECKPOINT_FILES or path.suffix == ".safetensors"):
            path.unlink()


def run_make_tiny(args: argparse.Namespace) -> int:
    overrides = {}
    if args.layers is not None:
        if args.layers < 1:
            raise ValueError(f"--layers={args.layers} must be at least 1")
        overrides["num_hidden_layers"] = args.layers
    out: Path = args.out
    _check_out_dir(out, args.force)
    dtype = DTYPES[args.dtype] if args.dtype is not None else None
    try:
        make_tiny(args.arch, out, args.preset, args.seed, dtype=dtype, fp8=args.fp8,
                  tokenizer=True, **overrides)  # fmt: skip
    except RuntimeError as err:  # transformers missing or too old: say how to fix it
        print(f"hisparse make-tiny: error: {err}", file=sys.stderr)
        return EXIT_FAILURE
    kw = tiny_config_kwargs(args.arch, args.preset, fp8=args.fp8, **overrides)
    layers = kw["num_hidden_layers"]
    written = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in written)
    dtype_name = args.dtype or ("float32" if args.preset == "tiny" else "bfloat16")
    if args.fp8:
        dtype_name = f"fp8 e4m3 (128x128 ue8m0 scales, MTP layer), the rest {dtype_name}"
    print(
        f"wrote {out} ({size / 2**20:.1f} MiB: {', '.join(p.name for p in written)})\n"
        f"  arch {args.arch}, preset {args.preset}, {layers} layer{'s' * (layers != 1)}, "
        f"hidden {kw['hidden_size']}, {dtype_name}, seed {args.seed}\n"
        f"  indexer {kw['index_n_heads']} heads x {kw['index_head_dim']}, "
        f"index_topk {kw['index_topk']}"
    )
    return 0
