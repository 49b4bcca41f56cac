# specmoe: `make demo` runs the bundled demo model, `make test` runs the test suite.
# Both create a local .venv on first use. torch is installed first, on its own:
#   TORCH        the requirement (default torch==2.13.0, which this project's machines serve as the CPU
#                build from local disk; on a normal machine PyPI's Linux torch is the large CUDA build)
#   TORCH_INDEX  an index to take torch from, e.g. https://download.pytorch.org/whl/cpu (CPU-only build)
#                or https://download.pytorch.org/whl/cu128 (CUDA 12.8); default: pip's configured index
# e.g. `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`. The choice applies when .venv is
# created: run `make clean` first to switch an existing .venv to another torch build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
MUTATE_ARGS ?=

.PHONY: setup demo test bench mutate clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"$(if $(strip $(TORCH_INDEX)), --index-url "$(strip $(TORCH_INDEX))")
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/specmoe generate --prompt "def fibonacci(n):" --prompt "And God said," \
		--prompt "The json module" --max-tokens 48 --threads 1 \
		--offload disk --cache-experts 8 --decoding specmoe --draft-experts 4 --num-draft-tokens 4

# the suite runs on the native CPU kernels where they build; the equality tests (families against transformers,
# offloaded == resident, speculative == plain, batch invariance, storage formats, seeded sampling) run a second
# time on the torch path (SPECMOE_NATIVE=0), about a minute more
TORCH_PATH_TESTS := tests/models/test_hf_equivalence.py tests/models/test_families.py \
	tests/models/test_native_formats.py tests/models/test_batch_invariance.py tests/experts/test_equivalence.py \
	tests/decoding/test_specmoe.py tests/decoding/test_sampling.py tests/formats/test_storage.py

test: setup
	$(BIN)/python -m pytest -q
	SPECMOE_NATIVE=0 $(BIN)/python -m pytest -q -p no:cacheprovider $(TORCH_PATH_TESTS)

# the README's Results block: measured into benchmarks/results/ (results.json, plots, the results page), then
# regenerated from it. About 10-15 min on a 2-core CPU machine (estimated from a measured reduced run); the
# preset starts no new measurement after 24 min
bench: setup
	$(BIN)/specmoe bench --headline --out benchmarks/results
	$(BIN)/python -m specmoe.bench.report

# the mutation check (docs/mutation.md): each planted bug of specmoe/dev/mutants.py in a temporary copy of the tree,
# only the tests that cover it run; the working tree is never modified. `make mutate MUTATE_ARGS="--only NAME"`
mutate: setup
	$(BIN)/python -m specmoe.dev.mutate $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
