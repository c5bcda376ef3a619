#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the built-in default model, sharded over 2 local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HSDP_CACHE=${HSDP_CACHE:-$PWD/.cache/hsdp}
exec .venv/bin/hsdp demo --use-hsdp --hsdp-shard-size 2 "$@"
