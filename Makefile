# One-command set-up: every target that needs Python makes .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-gpu lint install goldens clean

$(STAMP): pyproject.toml
	@test -x $(PY) || "$$(scripts/find_python.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

## Serve the bundled demo model on http://127.0.0.1:8000 (OpenAI-compatible API).
## Server flags go through ARGS: make serve ARGS="--port 9000 --max-waiting 256"
serve: $(STAMP)
	$(VENV)/bin/jaxinfer serve $(ARGS)

## The CPU test suite (what CI runs). Tests marked `gpu` (tests/gpu/) are skipped on a CPU.
## Two workers; loadgroup keeps each file, and files sharing a session fixture, on one (the
## tiny-model server's files: on two groups, one server each), and the groups of files marked slow
## start first (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --timeout 900 --max-worker-restart 0 -p no:cacheprovider

## The GPU checks (tests/gpu/: the kernels at real sizes, engine parity); needs a CUDA GPU and '.[gpu]'.
test-gpu: $(STAMP)
	JAX_PLATFORMS=cuda $(PY) -m pytest tests/gpu -m gpu --timeout 900 -p no:cacheprovider

## ruff (configured in pyproject.toml), installed by the test extra; CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

## Regenerate the HF-parity fixtures (needs torch + transformers in a separate Python 3.11 venv).
goldens:
	@test -x .goldenvenv/bin/python || python3 -m venv .goldenvenv
	.goldenvenv/bin/pip install -q torch==2.13.0 transformers==5.24.0 safetensors numpy
	.goldenvenv/bin/python tests/fixtures/make_golden.py
	.goldenvenv/bin/python tests/fixtures/make_golden_rope.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
