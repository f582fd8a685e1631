import os
import tempfile

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# A private Hugging Face cache for the test session (huggingface_hub reads it at import).
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf-cfp-tests-"))

# Tiny models are dominated by per-op overhead: on 2 busy cores a second intra-op thread only
# contends (a 3-step DPO run took 5.7 s with 2 threads, 0.5 s with 1).
torch.set_num_threads(1)
