#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the built-in tiny Wan video pipeline, sharded over 2 local ranks,
# writing outputs/cat.mp4. Extra args go to `hsdp generate` (e.g. --num-inference-steps 8). Built-in models are
# cached where every `hsdp` command caches them: $HSDP_CACHE, default ~/.cache/hsdp.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p outputs
exec .venv/bin/hsdp generate --model tiny-wan --use-hsdp --hsdp-shard-size 2 \
  --prompt "A cat playing piano" --output outputs/cat.mp4 "$@"
