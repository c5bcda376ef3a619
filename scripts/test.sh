#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, multi-rank tests included. Extra args go to pytest.
# Two pytest workers, each taking whole test files (module fixtures are built once) or single docs (the groups of
# tests/conftest.py): a multi-rank test keeps about 1.3 cores busy, so two at a time fill a 2-core machine. HSDP_TEST_WORKERS=0 runs in one process (the gpu tier on
# one device, or to debug).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
workers=${HSDP_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadgroup "$@"
