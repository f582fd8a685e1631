"""Shared setup for the whole suite: an offline, private Hugging Face cache, one intra-op thread,
and the fixtures every test module may use (`local_hub`)."""

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# A private Hugging Face cache for the test session (huggingface_hub reads it at import).
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf-cfp-tests-"))

# Tiny models are dominated by per-op overhead: on 2 busy cores a second intra-op thread only
# contends (a 3-step DPO run took 5.7 s with 2 threads, 0.5 s with 1).
torch.set_num_threads(1)


from support.hub_server import LocalHub, hub_offline_mode  # noqa: E402  (after HF_HOME is set)
from transformers.utils.logging import warning_once  # noqa: E402


@pytest.fixture(autouse=True)
def _empty_warning_once_cache() -> None:
    """transformers' `logger.warning_once` remembers every message for the life of the process: each test starts
    with it empty, so a test that expects a warning sees it whatever ran before it."""
    warning_once.cache_clear()


@pytest.fixture
def local_hub() -> Iterator[LocalHub]:
    """A started `LocalHub` (tests/support/hub_server.py), with huggingface_hub's offline flag turned
    off and the hub set as the client's default endpoint for the test."""
    with hub_offline_mode(False), LocalHub() as hub, hub.as_default_endpoint():
        yield hub
