# The README's two commands. Both create .venv if it is missing, install, and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; a box that already has a (CUDA) torch keeps it.
TORCH_SPEC ?= torch==2.13.0

# make serve: a small cartridge of the Quellmere document (built once by cartridges-distill), served on loopback
SERVE_MODEL ?= smollm2-135m-instruct
SERVE_DIR ?= runs/serve/cartridges
SERVE_PORT ?= 8000

.PHONY: install demo test lint serve clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m zoo.demo

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto --maxprocesses 4 --durations=15

$(SERVE_DIR)/quellmere/cartridge.safetensors: | install
	$(VENV)/bin/cartridges-distill model=$(SERVE_MODEL) method=ntp \
		corpus.path=experiments/cartridges_tradeoff/document.md output=$(SERVE_DIR)/quellmere \
		num_tokens=256 steps=2 pack_len=256 checkpoint_every=2 progress=false overwrite=true

serve: install $(SERVE_DIR)/quellmere/cartridge.safetensors
	$(VENV)/bin/cartridges-serve --model $(SERVE_MODEL) --cartridges $(SERVE_DIR) --host 127.0.0.1 --port $(SERVE_PORT)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
