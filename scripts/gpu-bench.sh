#!/usr/bin/env bash
# The GPU run in one call (issue 29): the gpu test tier, then every inference and training benchmark row at Wan
# 2.1 1.3B's width on the CUDA devices present, each row under its own time limit so the whole run fits in about
# 10 minutes on one GPU. JSON goes to benchmarks/results/gpu-*.json, every row's log beside it, and a summary table
# (row, world, exit status, seconds, JSON) ends the run. Run it first whenever a GPU is available:
#
#   bash scripts/gpu-bench.sh                          # with .venv (HSDP_TORCH_SPEC="torch>=2.11" bash scripts/setup.sh)
#   PYTHON_BIN=python3 bash scripts/gpu-bench.sh       # a machine whose python3 already has torch + hsdp's deps
#   bash scripts/gpu-bench.sh --dry-run                # print the rows and their commands, run nothing
#
# Worlds: 1 and, with two or more devices, 2 (HSDP over two GPUs; NCCL needs one device per rank). A row that fails
# or runs out of time is reported in the table with its log and does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON_BIN:-.venv/bin/python}
OUT=${HSDP_GPU_BENCH_DIR:-benchmarks/results}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

devices=0
if [ "$DRY" = 0 ]; then
  devices=$(PYTHONPATH=src "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$devices" = 0 ]; then
    echo "gpu-bench: no CUDA device is visible to $PY (torch.cuda.device_count() == 0); run it on a GPU machine," \
      "or pass --dry-run to print the rows" >&2
    exit 2
  fi
fi
world=$([ "$devices" -ge 2 ] && echo 2 || echo 1)
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1

# name | seconds allowed | command (JSON path last, so the table can name it)
ROWS=(
  "gpu-tier|150|env HSDP_GPU_BENCH_OUTPUT=$OUT/gpu-inference_cache-tier.json $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py --junitxml=$OUT/gpu-tier.xml"
  "inference|120|$PY benchmarks/inference.py --worlds $world --layers 4 --tokens 1024 4096 --repeats 3 --output $OUT/gpu-inference.json"
  "inference-compile|120|$PY benchmarks/inference_cache.py --skip-caches --compile-width 1536 --compile-size 256 --compile-frames 17 --output $OUT/gpu-inference_cache.json"
  "train-diffusion-lora|90|$PY benchmarks/train_diffusion.py --world $world --blocks 4 --only lora --output $OUT/gpu-train_diffusion-lora.json"
  "train-diffusion-full|60|$PY benchmarks/train_diffusion.py --world $world --blocks 4 --only full --output $OUT/gpu-train_diffusion-full.json"
  "train-lm|60|$PY benchmarks/train.py --world $world --output $OUT/gpu-train.json"
  "offload-layers|90|$PY benchmarks/offload_layers.py --world $world --width 1536 --blocks 16 --side 64 --repeats 5 --output $OUT/gpu-offload_layers.json"
)
# The VAE split needs a device per rank: Wan 2.1's VAE (random weights) decoding 33 x 512 x 512, 2 ranks vs one
[ "$world" = 2 ] && ROWS+=("vae-parallel|120|$PY benchmarks/vae_parallel.py --cases wan-vae image --repeats 3 --output $OUT/gpu-vae_parallel.json")

summary=()
for row in "${ROWS[@]}"; do
  IFS='|' read -r name limit cmd <<< "$row"
  if [ "$DRY" = 1 ]; then
    echo "$name (${limit}s): $cmd"
    continue
  fi
  echo "== $name (at most ${limit}s): $cmd"
  started=$SECONDS
  # shellcheck disable=SC2086  # the command is a word list on purpose
  timeout --kill-after 10 "$limit" $cmd 2>&1 | tee "$OUT/$name.log"
  status=${PIPESTATUS[0]}
  [ "$status" = 124 ] && status="timed out"
  summary+=("| $name | $world | $status | $((SECONDS - started)) | ${cmd##* } |")
done

[ "$DRY" = 1 ] && exit 0
echo
echo "| row | world | exit | seconds | json |"
echo "|---|---|---|---|---|"
printf '%s\n' "${summary[@]}" | tee "$OUT/gpu-bench-summary.md"
