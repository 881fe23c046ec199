# make train: set up .venv and train on the embedded Shakespeare data (GPU-sized if CUDA is present)
# make test:  set up .venv and run the test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch 2.13.0: a local CPU wheel on our CI machines; on a CUDA machine pip's default build
TORCH  ?= torch==2.13.0
# the preset follows the hardware, and says so
PRESET := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: setup train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements.txt
	touch $@

train: setup
	@echo "make train: experiment=$(PRESET) ($(if $(filter gpu,$(PRESET)),CUDA GPU found,no CUDA GPU: CPU-sized run))"
	$(PY) train.py experiment=$(PRESET) $(ARGS)

test: setup
	$(PY) -m pytest -q tests $(ARGS)

bench: setup
	$(PY) scripts/bench_attention.py $(ARGS)

clean:
	rm -rf $(VENV) .cache outputs multirun
