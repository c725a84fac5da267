# One entry point for developer tasks. Each target creates .venv on first use (CPU torch wheel, pinned).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: bench demo test gpu-test lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

bench: $(VENV)/.installed
	$(VENV)/bin/flashattn bench $(ARGS)

demo: $(VENV)/.installed
	$(VENV)/bin/flashattn demo $(ARGS)

# CPU suite: Triton kernels under the interpreter, the torch backend, the harness, the IO model.
# One BLAS thread per xdist worker: two workers already fill the two CI cores.
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(VENV)/bin/pytest -m "not gpu" -q -n 2 $(ARGS)

# on a GPU machine (the device): bf16/fp16 at real sizes, torch.compile, 128K tokens
gpu-test:
	PYTHONPATH=src python3 -m pytest -m gpu -q $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests scripts
