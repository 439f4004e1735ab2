"""Shared test setup."""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI stays reproducible: a failure seen
# once is seen again); HISPARSE_HYPOTHESIS=explore draws fresh ones, for hunting.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("HISPARSE_HYPOTHESIS") == "explore" else "fixed")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: on a busy 2-core CI machine spinning OpenMP workers made each small
    matmul far slower than running it on one core (and two pytest-xdist workers of two
    threads each on two cores ran some engine tests ten times slower). numba's threads are
    started first: starting them (the first parallel kernel, or numba.set_num_threads) sets
    the OpenMP runtime it shares with torch to NUMBA_NUM_THREADS threads (the cores), which
    torch then used for the rest of the session."""
    try:
        import numba

        numba.get_num_threads()  # starts numba's thread pool now
    except ImportError:
        pass
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# The suite runs the library's default offload policy ("under_pressure"): a test that needs
# requests to read through the hot buffers where the GPU pool has room asks for it with
# ``HiSparseConfig(offload="always")``. A policy set in the shell would change what every
# other test runs, so it is dropped here.
os.environ.pop("HISPARSE_OFFLOAD", None)
# CPU pools start poisoned (0xFF: NaN) as GPU pools always do, so that a read of a row nothing
# wrote fails a test instead of passing as zero (the library skips the CPU fill: it is slow).
os.environ.setdefault("HISPARSE_POISON", "1")
# The CPU suite runs every Triton kernel under Triton's interpreter, which must be on before
# Triton first defines a kernel: whatever module a test collection imports first (an engine
# import reaches the fused and fp8 kernels), the kernels are then the interpreter's. Where a
# GPU is present (tests/gpu, which shares this file) the kernels compile for it instead: the
# interpreter there would run every GPU test's kernels on the host.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _parse_the_bundled_gguf_once():
    """An engine built on the bundled SmolLM2 reads its GGUF twice (weights, tokenizer), and
    each read parses every metadata string (~2.5 s for the 49k-token vocabulary) into the same
    `GgufFile`. In this process the suite parses the file once per ``keys`` and hands later
    builds that parsed file: they still dequantize every tensor and build the tokenizer from
    the metadata. Other files, and the tests that call `read_gguf` themselves
    (test_gguf_loader, test_llama_smollm2), read uncached; so do spawned TP ranks."""
    try:
        from hisparse.models import gguf_loader, tokenizer
        from hisparse.models.smollm2 import smollm2_gguf_path

        bundled = smollm2_gguf_path().resolve()
    except (ImportError, FileNotFoundError):
        yield
        return
    read = gguf_loader.read_gguf
    parsed = {}

    def read_gguf(path, *, keys=None):
        p = Path(path)
        if not p.is_file() or p.resolve() != bundled:
            return read(path, keys=keys)
        st = p.stat()
        key = (keys, st.st_mtime_ns, st.st_size)
        if key not in parsed:
            parsed[key] = read(path, keys=keys)
        return parsed[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf_loader, "read_gguf", read_gguf)
    mp.setattr(tokenizer, "read_gguf", read_gguf)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch, seed=0, preset="tiny", **overrides)``: the folder of
    `make_tiny`'s checkpoint, written once per session (per xdist worker) and shared by every
    module that asks for the same one. Tests read it and never write into it (one that needs
    its own files makes its own). Needs transformers: only the tests that use a checkpoint
    are skipped without it (and fail under CI, see `pytest_runtest_makereport`)."""
    pytest.importorskip("transformers")
    from hisparse.models.tiny import make_tiny

    built: dict[str, Path] = {}

    def get(arch: str, seed: int = 0, preset: str = "tiny", **overrides) -> Path:
        key = repr((arch, seed, preset, sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-seed{seed}")
            built[key] = make_tiny(arch, out, preset, seed, **overrides)
        return built[key]

    return get


@pytest.fixture
def forbid_reference(monkeypatch):
    """``forbid_reference(fn, ...)``: for the rest of the test, each reference ``fn`` raises
    wherever it is bound (its own module and every ``hisparse`` module that imported it by
    name), so a dispatch point that falls back to it, or a kernel path that became a call of
    it, fails the test instead of passing as the reference's own result. Returns the names
    of the places patched (a reference bound nowhere is an error: the test would prove
    nothing)."""

    def forbid(*fns) -> list[str]:
        patched = []
        for fn in fns:
            what = f"{fn.__module__}.{fn.__qualname__}"

            def refuse(*args, _what=what, **kwargs):
                raise AssertionError(f"{_what} ran where its kernel was meant to run")

            for name, module in list(sys.modules.items()):
                if module is None or not name.startswith("hisparse"):
                    continue
                for attr, value in list(vars(module).items()):
                    if value is fn:
                        monkeypatch.setattr(module, attr, refuse)
                        patched.append(f"{name}.{attr}")
            assert any(p.startswith(fn.__module__ + ".") for p in patched), what
        return patched

    return forbid


# --- pytest-xdist (`make test` runs two workers, --dist loadgroup) ---------------------------
#: Modules whose module-scoped fixtures or module caches build engines, servers or models
#: (seconds each): under --dist loadgroup their tests stay on one worker, which builds them
#: once. Tests of the other modules are dealt out one at a time. The tensor- and
#: data-parallel modules also stay together: each of their tests spawns its ranks, and one
#: such test at a time is enough for a 2-core machine.
ONE_WORKER_MODULES = frozenset(
    {
        "test_api_outputs",
        "test_data_parallel",
        "test_engine_smollm2",
        "test_engine_v4",
        "test_fp8_model",
        "test_fp8_tensor_parallel",
        "test_gguf_loader",
        "test_llama_smollm2",
        "test_models_dsa",
        "test_models_v4",
        "test_output_processor",
        "test_plan_data_parallel",
        "test_scheduler_property",
        "test_serve",
        "test_serve_faults",
        "test_serve_limits",
        "test_serve_shutdown",
        "test_serve_fields",
        "test_serve_soak",
        "test_serve_tools",
        "test_speculative_smollm2",
        "test_structured_outputs",
        "test_tensor_parallel",
    }
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, with the modules of `ONE_WORKER_MODULES` as groups. (xdist marks a
    group by a suffix of the test's node id, which pytest 9.2 no longer lets a plugin set, so
    ``xdist_group`` marks do not group here; this scheduler reads the module instead.) The
    largest groups are dealt first (xdist's loadscope order), then one test at a time."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if Path(path).stem in ONE_WORKER_MODULES:
                return path
            return nodeid

    return ModuleGroups(config, log)


# --- under CI, a skip is a failure ------------------------------------------------------------
# `make test` installs every optional part, so a test skipped there (a dependency that did not
# install or import, a kernel module imported outside the Triton interpreter) is a test that
# silently stopped running. With CI set (CI=true, as CI services set it) such a skip fails the
# run instead: at collection (a module-level importorskip) as a collection error, in a test or
# its fixtures as a failure/error naming the skip's reason. xfail is left alone.


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _fail_the_skip(report) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    where = f" ({longrepr[0]}:{longrepr[1]})" if isinstance(longrepr, tuple) else ""
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI={os.environ.get('CI')!r}, where every test must run: {reason}{where}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and _under_ci():
        _fail_the_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped and _under_ci():
        _fail_the_skip(report)
    return report
