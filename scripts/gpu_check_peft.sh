#!/usr/bin/env bash
# On a CUDA machine: the QLoRA tests (tests/unit/protection/test_qlora.py) with the quantized models loaded
# on the GPU (CFP_TEST_DEVICE=cuda), where bitsandbytes runs its CUDA kernels instead of its CPU ones.
# Needs a CUDA build of torch and bitsandbytes: install the CUDA torch into .venv, then
# `bash scripts/setup.sh dev,qlora`. Python: $PYTHON, else .venv/bin/python, else python3.
# Extra arguments go to pytest. About a minute (imports and CUDA start-up); capped at 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
"$python" - <<'PY'
import torch
import bitsandbytes

assert torch.cuda.is_available(), "no CUDA device visible to torch: this check is for a CUDA machine"
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(0),
      "| bitsandbytes", bitsandbytes.__version__)
PY
CFP_TEST_DEVICE=cuda timeout 180 "$python" -m pytest -q -rs -p no:cacheprovider tests/unit/protection/test_qlora.py "$@"
