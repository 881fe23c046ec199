# make train: set up .venv and train on the embedded Shakespeare data (GPU-sized if CUDA is present)
# make test:  set up .venv and run the test suite (what CI runs); on a CUDA machine the GPU tests run too
# In an environment you made yourself, name its interpreter and nothing is installed:
#   make test PY=python3
PYTHON ?= python3
VENV   := .venv
PY     ?= $(VENV)/bin/python
# the preset follows the hardware, and says so
PRESET := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# A CUDA machine gets the torch and triton the kernels were tuned and tested with on the H100
# (TMA descriptors and Gluon change between triton releases); a CPU machine gets torch 2.13.0
# (a local CPU wheel on our CI machines) and the newest triton kernels/runtime/internals.py knows,
# whose interpreter runs the tests.
# Either is one override: make train TORCH=torch==2.13.0 "TRITON=triton>=3.6,<3.10" (not measured on a GPU).
ifeq ($(PRESET),gpu)
TORCH  ?= torch==2.11.0
TRITON ?= triton==3.6.0
else
TORCH  ?= torch==2.13.0
TRITON ?= triton>=3.6,<3.10
endif
# one stamp per pair: naming another pair installs it into the same .venv
comma  := ,
STAMP  := $(VENV)/.installed-$(subst <,,$(subst >,,$(subst =,,$(subst $(comma),-,$(TORCH)-$(TRITON)))))
# the Hopper kernel is Gluon of this triton release; where the venv has another, the test suite
# compiles the kernel for sm_90 with a copy of it kept apart (tests/test_hopper.py): `make test`
# installs it, `make train` does not need it
GLUON_TRITON := triton==3.6.0
GLUON_STAMP  := $(VENV)/gluon-triton/.installed
# NVRTC as torch's CUDA 13.0 wheels load it for cuDNN: its first compile in a process takes SIGTERM
# from Python's handler (tests/test_stops.py); from the package index, and where it cannot be had,
# that test is skipped and the next `make test` tries again
NVRTC        := nvidia-cuda-nvrtc==13.0.88
NVRTC_STAMP  := $(VENV)/nvrtc/.installed
SETUP  := $(if $(filter command line,$(origin PY)),,setup)
TEST_SETUP := $(if $(SETUP),$(GLUON_STAMP) $(NVRTC_STAMP))

.PHONY: setup train test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH)" "$(TRITON)"
	$(VENV)/bin/python -m pip install -q -r requirements.txt "$(TORCH)" "$(TRITON)"
	@$(VENV)/bin/python -c "import torch, triton; print('installed torch', torch.__version__, 'triton', triton.__version__)"
	touch $@

$(GLUON_STAMP): $(STAMP)
	if ! $(VENV)/bin/python -c "import triton; assert triton.__version__.startswith('3.6.')" 2>/dev/null; then \
	  $(VENV)/bin/python -m pip install -q --no-deps --target $(VENV)/gluon-triton "$(GLUON_TRITON)"; fi
	mkdir -p $(@D) && touch $@

$(NVRTC_STAMP): $(STAMP)
	if $(VENV)/bin/python -m pip install -q --no-deps --target $(VENV)/nvrtc "$(NVRTC)"; then touch $@; \
	else rm -rf $(VENV)/nvrtc; echo "$(NVRTC) not installed: tests/test_stops.py skips its NVRTC test"; fi

train: $(SETUP)
	@echo "make train: experiment=$(PRESET) ($(if $(filter gpu,$(PRESET)),CUDA GPU found,no CUDA GPU: CPU-sized run))"
	$(PY) train.py experiment=$(PRESET) $(ARGS)

# -q unless ARGS brings its own verbosity; the closing "N passed" line shows either way. One pytest-xdist
# worker per core, at most 8 (most tests start processes of their own), where PY has xdist (expanded
# when the recipe runs, after setup); ARGS="-n 0" runs the tests in turn
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
XDIST = $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n $(WORKERS) --dist worksteal")
test: $(SETUP) $(TEST_SETUP)
	$(PY) -m pytest $(if $(filter -q% -v% --verbose --quiet,$(ARGS)),,-q) $(XDIST) \
	  $(if $(filter tests%,$(ARGS)),,tests) $(ARGS)

bench: $(SETUP)
	$(PY) scripts/bench_attention.py $(ARGS)

clean:
	rm -rf $(VENV) .cache outputs multirun bench
