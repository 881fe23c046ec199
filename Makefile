# make train: set up .venv and train on the embedded Shakespeare data (GPU-sized if CUDA is present)
# make test:  set up .venv and run the test suite (what CI runs); on a CUDA machine the GPU tests run too
# In an environment you made yourself, name its interpreter and nothing is installed:
#   make test PY=python3
PYTHON ?= python3
VENV   := .venv
PY     ?= $(VENV)/bin/python
# torch 2.13.0: a local CPU wheel on our CI machines; on a CUDA machine pip's default build
TORCH  ?= torch==2.13.0
# the preset follows the hardware, and says so
PRESET := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
SETUP  := $(if $(filter command line,$(origin PY)),,setup)

.PHONY: setup train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -r requirements.txt
	touch $@

train: $(SETUP)
	@echo "make train: experiment=$(PRESET) ($(if $(filter gpu,$(PRESET)),CUDA GPU found,no CUDA GPU: CPU-sized run))"
	$(PY) train.py experiment=$(PRESET) $(ARGS)

test: $(SETUP)
	$(PY) -m pytest -q tests $(ARGS)

bench: $(SETUP)
	$(PY) scripts/bench_attention.py $(ARGS)

clean:
	rm -rf $(VENV) .cache outputs multirun bench
