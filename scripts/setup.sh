#!/usr/bin/env bash
# Create .venv and install hsdp with its test and serving extras. Idempotent: re-runs only when pyproject changes.
# CPU machines get the pinned CPU build of torch; on a GPU machine set HSDP_TORCH_SPEC (e.g. "torch>=2.13") to keep
# the build you have, since the package itself only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${HSDP_TORCH_SPEC:-torch==2.13.0}
EXTRAS=${HSDP_EXTRAS:-dev}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=".venv/.hsdp-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) $TORCH_SPEC $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv ($TORCH_SPEC, extras: $EXTRAS) ..." >&2
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
# torch first and pinned, so no dependency pulls a different (multi-GB CUDA) build. Bytecode is compiled once
# afterwards on every core (pip compiles one file at a time: about 40 s of a 75 s set-up on 2 cores).
.venv/bin/python -m pip install --quiet --no-compile "$TORCH_SPEC" 2>&1 | grep -v "is ignored" >&2 || true
.venv/bin/python -m pip install --quiet --no-compile -e ".[$EXTRAS]" "$TORCH_SPEC" 2>&1 | grep -v "is ignored" >&2 || true
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 || true
.venv/bin/python -c "import hsdp, torch, diffusers, transformers, fastapi" # fail loudly if the install did not work
echo "$want" > "$stamp"
