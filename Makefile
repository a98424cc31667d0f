# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned in the CPU install path: 2.13.0 is the CPU wheel; an unpinned torch pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
# The DeepSpeed the slow tests were verified with (an sdist; its ops build just in time, not here).
DEEPSPEED_SPEC ?= deepspeed==0.19.0
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-gpu test-ui lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The deepspeed extra for the slow tests, with the pinned torch on the same command line so the
# resolver keeps the CPU wheel instead of pulling a CUDA torch.
$(VENV)/.deepspeed-installed: $(VENV)/.installed
	DS_BUILD_OPS=0 $(PIP) install -q "$(TORCH_SPEC)" "$(DEEPSPEED_SPEC)" -e '.[dev,deepspeed]'
	touch $@

demo: setup
	$(VENV)/bin/cleaner demo

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: setup $(VENV)/.deepspeed-installed
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# The browser tests of `cleaner ui`: Debian's Chromium and its driver from apt (root, or sudo),
# selenium from pip (pointed at /usr/bin/chromedriver: no browser is downloaded at test time).
# CLEANER_UI_SCREENSHOTS=docs/figures refreshes the README's screenshot.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

$(VENV)/.ui-test-installed: $(VENV)/.installed
	$(PIP) install -q "$(TORCH_SPEC)" -e '.[ui-test]'
	touch $@

test-ui: setup $(VENV)/.ui-test-installed
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; \
	fi
	$(PY) -m pytest -q -m ui $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check cleaner tests bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
