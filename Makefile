# The README's two set-up commands. Each creates the environment on a fresh machine first.
# Without a GPU the CPU build of torch is installed before the project, so pip does not pull the
# multi-GB CUDA build; with a GPU (nvidia-smi present) pip resolves torch as usual.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test test-fast test-faults install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no GPU found: installing the CPU build of torch"; \
		$(PY) -m pip install -q --timeout 20 --retries 1 "torch==2.13.0" --extra-index-url $(TORCH_CPU_INDEX); \
	fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The agent on the bundled trainer, CPU, offline tier ($0): baseline, diagnosis, candidates, report.
demo: $(STAMP)
	$(VENV)/bin/sg-opt optimize --target haste-rec --size small --device cpu --tier offline --max-minutes 5

test: $(STAMP)
	-@command -v chromium >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium))) >/dev/null 2>&1 || true
	$(PY) -m pytest

# The edit-test loop, under 3 minutes on 2 cores: the suite without the tests marked slow (agent runs, gates,
# torchrun jobs, fault injection: real processes for seconds to minutes each) or gpu (they need CUDA).
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu"

# The fault-injection trials at full strength: 20 seeded SIGKILLs each of optimize, bench and gate.
test-faults: $(STAMP)
	SG_OPT_FAULT_TRIALS=20 $(PY) -m pytest tests/sg_opt/test_fault_injection.py

clean:
	rm -rf $(VENV) runs .pytest_cache
