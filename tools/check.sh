#!/usr/bin/env bash
# The project's whole check: lint, types, tests — and fail on leaks the tests can't see.
# Usage: bash tools/check.sh [pytest args...]   (inside the project's virtualenv)
set -euo pipefail
cd "$(dirname "$0")/.."

ruff check .
ruff format --check .
mypy

log=$(mktemp)
trap 'rm -f "$log"' EXIT
python -m pytest "$@" 2>&1 | tee "$log"

# Python prints resource_tracker complaints at interpreter exit, outside any test.
if grep -q "resource_tracker" "$log"; then
    echo "FAIL: resource_tracker warnings in the test output" >&2
    exit 1
fi
leftover=$(ls /dev/shm | grep -E '^(shmslots-test-|shmslots-pd-|sglang-)' || true)
if [ -n "$leftover" ]; then
    echo "FAIL: the tests left segments in /dev/shm: $leftover" >&2
    exit 1
fi
