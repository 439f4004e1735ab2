"""`hisparse.envs`: the one registry of the ``HISPARSE_*`` environment variables."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hisparse import envs

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_is_read_through_the_registry():
    """No module but `hisparse/envs.py` reads a ``HISPARSE_*`` variable from the environment,
    and every ``HISPARSE_*`` name the package mentions is registered."""
    named = set()
    for path in sorted((ROOT / "src" / "hisparse").rglob("*.py")):
        text = path.read_text()
        named |= set(re.findall(r"HISPARSE_[A-Z0-9_]+", text))
        if path.name == "envs.py":
            continue
        for line in text.splitlines():
            # not ours: triton's, torchrun's, OpenMP's
            others = ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "OMP_WAIT_POLICY")
            if "os.environ" in line and not any(o in line for o in others):
                pytest.fail(f"{path.relative_to(ROOT)} reads the environment itself: {line}")
    assert named <= set(envs.REGISTRY), sorted(named - set(envs.REGISTRY))


def test_the_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in envs.REGISTRY if f"`{name}`" not in readme]
    assert not missing, missing


def test_values_are_parsed_checked_and_follow_the_environment(monkeypatch):
    monkeypatch.delenv("HISPARSE_OPS", raising=False)
    assert envs.value("HISPARSE_OPS") == "auto"
    monkeypatch.setenv("HISPARSE_OPS", "reference")
    assert envs.value("HISPARSE_OPS") == "reference"
    monkeypatch.setenv("HISPARSE_CPU_JIT", "0")
    assert envs.value("HISPARSE_CPU_JIT") is False
    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "2.5")
    assert envs.value("HISPARSE_TP_TIMEOUT") == 2.5
    monkeypatch.delenv("HISPARSE_TP_TIMEOUT")
    assert envs.value("HISPARSE_TP_TIMEOUT") is None
    monkeypatch.setenv("HISPARSE_ATTENTION", "fast")
    with pytest.raises(ValueError, match=r"HISPARSE_ATTENTION='fast'.*'reference'"):
        envs.value("HISPARSE_ATTENTION")
    monkeypatch.setenv("HISPARSE_ATTENTION", "triton")
    assert envs.backend("HISPARSE_ATTENTION", "cpu") == "triton"
    monkeypatch.setenv("HISPARSE_ATTENTION", "auto")
    assert envs.backend("HISPARSE_ATTENTION", "cpu") == "reference"
    assert envs.backend("HISPARSE_ATTENTION", "cuda") == "triton"


def test_the_command_sets_openmps_wait_policy_before_torch_loads():
    """`hisparse.cli_env` (``OMP_WAIT_POLICY=PASSIVE`` unless set: OpenMP reads it once, when
    torch loads) is the first of the package's modules `hisparse.cli` imports, after only the
    standard library and rich."""
    import ast

    tree = ast.parse((ROOT / "src" / "hisparse" / "cli.py").read_text())
    first = []
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            )
            first += [n for n in names if n and n != "__future__"]
    ours = [i for i, n in enumerate(first) if n.startswith("hisparse")]
    assert first[ours[0]] == "hisparse.cli_env", first
    assert all(n.split(".")[0] in sys.stdlib_module_names | {"rich"} for n in first[: ours[0]])
