# `make demo` and `make test` each set everything up on a fresh machine first.
.PHONY: setup demo test test-slow test-all lint

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: .venv/.installed

demo: .venv/.installed
	.venv/bin/python -m examples.demo

test: .venv/.installed
	.venv/bin/python -m pytest -q

test-slow: .venv/.installed
	.venv/bin/python -m pytest -q -m slow

test-all: .venv/.installed
	.venv/bin/python -m pytest -q -m "slow or not slow"

lint: .venv/.installed
	.venv/bin/ruff check .
