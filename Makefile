# One command each: `make demo`, `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test chaos inplace dropin lint demo bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned to the CPU wheel: a bare `torch` would resolve a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

chaos: $(STAMP)
	$(BIN)/python -m pytest -q -m chaos

inplace: $(STAMP)
	$(BIN)/python -m pytest -q -m inplace

dropin: $(STAMP)
	$(BIN)/python -m pytest -q -m dropin

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(STAMP)
	$(BIN)/elasticd demo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
