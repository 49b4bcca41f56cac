# specmoe: `make demo` runs the bundled demo model, `make test` runs the test suite.
# Both create a local .venv on first use. torch is pinned to the CPU build on this machine's disk:
# an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: setup demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/specmoe generate --prompt "def fibonacci(n):" --prompt "And God said," \
		--prompt "The json module" --max-tokens 48 --threads 1 \
		--offload disk --cache-experts 8 --decoding specmoe --draft-experts 4 --num-draft-tokens 4

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/specmoe bench --quick --out bench-results

clean:
	rm -rf $(VENV) .pytest_cache
