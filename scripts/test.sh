#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, multi-rank tests included. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
