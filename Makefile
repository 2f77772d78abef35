# Two entry points that work on a fresh machine (Python 3.11 + pip + the OS):
#   make demo  - the live character demo on CPU (tiny preset, built-in scripted agent)
#   make serve - talk to the character in a browser (the built-in offline agent hears your microphone)
#   make test  - the test suite (CPU; GPU tests are marked `gpu` and skipped without CUDA)
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo serve test lint venv browser clean

venv: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel; installing the project first would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,pipecat,livekit,fleet]'
	touch $@

# Debian's Chromium for the browser tests (Playwright drives /usr/bin/chromium; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi; }

demo: $(STAMP)
	$(VENV)/bin/charstream demo

# Talk to the character in a browser: the built-in offline agent hears the page's microphone.
serve: $(STAMP)
	$(VENV)/bin/charstream serve

# The venv and Debian's chromium install side by side.
test:
	@$(MAKE) -j2 --no-print-directory venv browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) demo-out
