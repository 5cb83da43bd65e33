# The two commands of the README: `make demo` (set up, then serve the embedded tiny model
# and answer a real request) and `make test` (set up, then every check CI runs).
# `make soak` runs the full soak load (240 requests, 32 at once); `make test` runs its short
# variant (40 requests, 8 at once) with everything else.
.PHONY: setup demo test soak

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/python tools/demo.py

test: setup
	scripts/test.sh

soak: setup
	SOAK_REQUESTS=240 SOAK_CONCURRENCY=32 .venv/bin/pytest tests/soak
