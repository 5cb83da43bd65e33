#!/usr/bin/env bash
# Every check CI runs: lint, format, types, then the test suite. Prints its wall time.
# The suite runs in two pytest-xdist workers, a test file each at a time (PYTEST_WORKERS=0 runs it
# in this process): most of its time is stock vLLM engine starts, which use one core each
# (tests/engines.py gives each running engine a core of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
trap 'echo "test.sh: wall time $(( $(date +%s) - start )) s"' EXIT
bin=.venv/bin
"$bin/ruff" check .
"$bin/ruff" format --check .
"$bin/mypy"
# --no-loadscope-reorder: files in tests/conftest.py's order (engine files first), not by test count
"$bin/pytest" -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
