# `make run`: set up and run the main job on the default model.  `make test`: set up and run the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= smollm2
# pytest-xdist processes for `make test`: the suite is mostly single-threaded lowering and compiling
TEST_WORKERS ?= 2
PROMPT ?= The three most important things to know about the ocean are

.PHONY: run test test-fast lint install clean
run: $(STAMP)
	$(BIN)/python -m tg_ds4 generate -m $(MODEL) -p "$(PROMPT)" -n 48

# tests/conftest.py prints the suite's wall time and names every test over a minute: CI gives `make test` 90 minutes,
# and it is kept within 20 on 2 cores
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the inner loop (a few minutes): unit tests and one float32 reference of each family (tests/conftest.py FAST)
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --fast

# ruff, and the package's layers (pyproject.toml [tool.importlinter])
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

install: $(STAMP)

# clang: tinygrad's CPU backend compiles kernels with it. A venv keeps the install to one place we own.
$(STAMP): pyproject.toml
	@command -v clang >/dev/null 2>&1 || { echo "installing clang (tinygrad CPU backend)"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; }
	@[ -x $(BIN)/python ] || $(PY) -m venv $(VENV) || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null && $(PY) -m venv $(VENV); }
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

clean:
	rm -rf $(VENV) build *.egg-info
