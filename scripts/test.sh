#!/usr/bin/env bash
# Every check CI runs: lint, format, types, then the test suite. Prints its wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
trap 'echo "test.sh: wall time $(( $(date +%s) - start )) s"' EXIT
bin=.venv/bin
"$bin/ruff" check .
"$bin/ruff" format --check .
"$bin/mypy"
"$bin/pytest" "$@"
