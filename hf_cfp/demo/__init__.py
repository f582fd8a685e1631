"""The demo and what it needs: bundled calibration and task data, offline model loading (the
embedded SmolLM2-135M, a local directory or GGUF file, a tiny random Llama)."""

from .models import load_embedded_model
from .run import run_demo

__all__ = ["load_embedded_model", "run_demo"]
