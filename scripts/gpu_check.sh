#!/usr/bin/env bash
# The GPU check in one command, for a lent GPU machine (no network; under 5 minutes):
#   scripts/gpu_check.sh            -> runs/bench_gpu.json + runs/bench_gpu.md (or under $OUT)
# Llama-3.2-1B-shaped dummy bf16 decode at batch 1: eager vs CUDA graphs vs inductor + graphs,
# as a fraction of the measured HBM roofline; transformers on the same weights if installed;
# then pytest tests/gpu. Says so (and exits 1) when torch, CUDA or a module is missing.
set -u
cd "$(dirname "$0")/.."
PY="${PY:-}"
if [ -z "$PY" ]; then
  for c in .venv/bin/python /work/main/.venv/bin/python python3 python; do
    if command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
OUT_DIR="${OUT:-runs}"
mkdir -p "$OUT_DIR"
echo "python: $PY ($("$PY" --version 2>&1))"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader
"$PY" - <<'PYEOF' || exit 1
import importlib.util, sys
need = ["torch", "numpy", "safetensors", "pytest"]
nice = ["transformers", "triton", "vllm", "sglang"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("optional:", ", ".join(f"{m}={'yes' if importlib.util.find_spec(m) else 'no'}" for m in nice))
if missing:
    print("GPU check cannot run: missing python modules:", ", ".join(missing))
    sys.exit(1)
import torch
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}")
PYEOF
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-$(nproc)}"
exec timeout 295 env PYTHONPATH="$PWD" "$PY" -m ultrafast.cli bench gpu \
  --out "$OUT_DIR/bench_gpu.json" "$@"
