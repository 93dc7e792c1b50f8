# One-command set-up: every target that needs Python makes .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-gpu install goldens bench-cpu clean

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

## The CPU test suite (what CI runs).
test: $(STAMP)
	$(PY) -m pytest -n 2 --timeout 900 -p no:cacheprovider

## Regenerate the HF-parity fixtures (needs torch + transformers in a separate Python 3.11 venv).
goldens:
	@test -x .goldenvenv/bin/python || python3 -m venv .goldenvenv
	.goldenvenv/bin/pip install -q torch==2.13.0 transformers safetensors numpy
	.goldenvenv/bin/python tests/fixtures/make_golden.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
