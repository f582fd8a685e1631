"""The demo and what it needs: bundled calibration and task data, offline model loading (the
embedded SmolLM2-135M, a local directory or GGUF file, a tiny random Llama)."""

from .run import run_demo

__all__ = ["run_demo"]
