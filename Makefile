# make demo / make test set up .venv by themselves on a fresh machine. make demo ARGS=--auto: plan, then train.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean fuzz

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sbpflow demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest src tests

# a long campaign of random programs (tests/fuzz): make fuzz N=5000
N ?= 5000
fuzz: $(STAMP)
	SBPFLOW_FUZZ_N=$(N) SBPFLOW_FUZZ_RANDOM=1 $(PY) -m pytest -q tests/fuzz -k random_program

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/eager_overhead.py --write
	$(PY) benchmarks/gpt_step.py --write
	$(PY) benchmarks/ddp_compare.py --write
	$(PY) benchmarks/ops_2proc.py --write
	$(PY) benchmarks/checkpoint_compare.py --write
	$(PY) benchmarks/graph_compare.py --write
	$(PY) benchmarks/data_prefetch.py --write

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
