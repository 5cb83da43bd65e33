# The two commands of the README: `make demo` (set up, then serve the embedded tiny model
# and answer a real request) and `make test` (set up, then every check CI runs).
.PHONY: setup demo test

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/python tools/demo.py

test: setup
	scripts/test.sh
