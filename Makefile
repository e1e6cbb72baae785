PYTHON ?= python
PIP ?= $(PYTHON) -m pip

.PHONY: install test lint format bench demo

# CPU torch first: an unpinned torch pulls several GB of CUDA wheels.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev,math,quantization]"

test:
	$(PYTHON) -m pytest -q tests

lint:
	ruff check .
	ruff format --check .

format:
	ruff check --fix .
	ruff format .

bench:
	$(PYTHON) benchmarks/bench_advantages.py

demo:
	trl-sae demo
