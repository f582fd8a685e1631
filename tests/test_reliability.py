"""Reliability (issue 6, items 3-5) not covered elsewhere: a tokenizer without a pad token, a
model that cannot generate, the security rules (no pickle, no trust_remote_code, safetensors +
JSON only, size-limited JSON) and a shortened soak run (scripts/soak.py)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.anchor.artifact import MAX_CONFIG_BYTES
from hf_cfp.errors import AnchorFormatError, CFPArgumentError

from support.tiny import anchor_for, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_cfp"
PROMPTS = ["two plus three", "what is the answer to the sum code print five"]  # different lengths: padded


# ---------------------------------------------------------------- bad inputs: tokenizer and model


def _estimate(model, tokenizer, **kwargs):
    options = dict(num_sequences=4, max_new_tokens=4, batch_size=2, seed=0, show_progress=False)
    return estimate_fisher(model, tokenizer, PROMPTS, **{**options, **kwargs})


@pytest.mark.parametrize("engine", ["batched", "loop"])
def test_tokenizer_without_pad_token_is_handled_and_gives_the_same_anchor(engine):
    with_pad = tiny_tokenizer()
    without_pad = tiny_tokenizer()
    without_pad.pad_token = None
    assert without_pad.pad_token_id is None and with_pad.pad_token_id is not None
    model = tiny_llama(vocab_size=len(with_pad))
    reference = _estimate(model, with_pad, engine=engine)
    anchor = _estimate(model, without_pad, engine=engine)  # padding is masked: the pad id is irrelevant
    assert anchor.fisher.keys() == reference.fisher.keys()
    assert all(torch.equal(anchor.fisher[n], reference.fisher[n]) for n in anchor.fisher)
    assert all(t.sum() > 0 for t in anchor.fisher.values() if t.numel() > 0)
    assert without_pad.pad_token is None  # the caller's tokenizer is not modified


def test_tokenizer_without_pad_or_eos_token_is_handled():
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = None, None
    model = tiny_llama(vocab_size=len(tokenizer))
    anchor = _estimate(model, tokenizer)
    assert all(torch.isfinite(t).all() for t in anchor.fisher.values())
    assert anchor.metadata["mean_response_tokens"] == 4  # no EOS: every response runs to max_new_tokens


class _NoLogits(torch.nn.Module):
    """Takes input_ids but returns a plain dict (an encoder, a value head...)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(400, 8)

    def forward(self, input_ids=None, **kwargs):
        return {"hidden_states": self.embed(input_ids)}


class _Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model cannot run")


class _SequenceClassifier(torch.nn.Module):
    """Returns .logits, but per sequence (batch, labels), not per token."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(400, 3)

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.embed(input_ids).mean(1))


class _NoCache(torch.nn.Module):
    """A causal LM forward (per-token logits) that ignores use_cache and returns no KV cache."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(400, 400)

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.embed(input_ids))


@pytest.mark.parametrize(
    "model, words",
    [(_NoLogits(), "returned dict"), (_Raises(), "RuntimeError: this model cannot run"),
     (torch.nn.Linear(3, 3), "calling Linear failed"), (_SequenceClassifier(), "logits of shape (1, 3)"),
     (torch.nn.Module(), "has no parameters")],
)
@pytest.mark.parametrize("estimator", ["sequence", "empirical"])
def test_a_model_that_cannot_generate_gets_a_clear_error(model, words, estimator):
    extra = {"responses": ["five", "five"]} if estimator == "empirical" else {}
    with pytest.raises(CFPArgumentError, match="needs a causal language model") as caught:
        _estimate(model, tiny_tokenizer(), estimator=estimator, **extra)
    assert words in str(caught.value) and ".logits" in str(caught.value)


def test_a_model_without_a_kv_cache_gets_a_clear_error_when_sampling():
    with pytest.raises(CFPArgumentError, match="no KV cache"):
        _estimate(_NoCache(), tiny_tokenizer())


# ---------------------------------------------------------------- security


def _sources() -> dict[str, str]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    return {str(f.relative_to(ROOT)): f.read_text() for f in files}


def _code_lines(text: str):
    """(line number, code) with comments removed; docstrings stay (a mention there is harmless
    but the patterns below only match calls and imports)."""
    for number, line in enumerate(text.splitlines(), 1):
        yield number, line.split("#", 1)[0]


def test_no_pickle_anywhere_in_the_library():
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|joblib|shelve|marshal)\b|\b(c?pickle|dill|joblib)\.(loads?|dumps?)\(")
    hits = [f"{path}:{n}: {line.strip()}" for path, text in _sources().items()
            for n, line in _code_lines(text) if pattern.search(line)]
    assert not hits, "pickle-based serialisation found:\n" + "\n".join(hits)


def test_every_torch_load_uses_weights_only():
    hits = []
    for path, text in _sources().items():
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start():text.find(")", match.start()) + 1]
            if "weights_only=True" not in re.sub(r"\s+", "", call):
                hits.append(f"{path}: {call}")
    assert not hits, "torch.load without weights_only=True:\n" + "\n".join(hits)


def test_trust_remote_code_is_never_turned_on():
    hits = [f"{path}:{n}: {line.strip()}" for path, text in _sources().items()
            for n, line in _code_lines(text) if re.search(r"trust_remote_code\s*=\s*True", line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("max_shard_size", ["5GB", 2000])
def test_saved_anchor_is_only_safetensors_and_json(tmp_path, max_shard_size):
    anchor_for(tiny_llama()).save_pretrained(tmp_path, max_shard_size=max_shard_size)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files and all(name.endswith((".safetensors", ".json")) for name in files), files
    assert any(name.endswith(".safetensors") for name in files)
    _assert_safetensors_and_json(tmp_path, files)


def _assert_safetensors_and_json(directory, files):
    from safetensors import safe_open

    for name in files:
        if name.endswith(".json"):
            json.loads((directory / name).read_text())
        elif name.endswith(".safetensors"):
            with safe_open(directory / name, framework="pt") as handle:
                assert list(handle.keys())


def test_pushed_folder_is_only_safetensors_json_and_the_readme(tmp_path, monkeypatch):
    import hf_cfp.anchor.artifact

    seen = {}

    def fake_push(folder, repo_id, path_in_repo, **kwargs):
        seen["files"] = sorted(p.name for p in Path(folder).rglob("*") if p.is_file())
        _assert_safetensors_and_json(Path(folder), seen["files"])
        seen["readme"] = (Path(folder) / "README.md").read_text()
        return "pushed"

    monkeypatch.setattr(hf_cfp.anchor.artifact, "push_folder", fake_push)
    assert anchor_for(tiny_llama()).push_to_hub("org/anchors", max_shard_size=2000) == "pushed"
    assert "README.md" in seen["files"]
    assert all(n.endswith((".safetensors", ".json")) for n in seen["files"] if n != "README.md"), seen["files"]
    assert sum(n.endswith(".safetensors") for n in seen["files"]) > 1  # sharded


def test_oversized_config_is_refused_before_it_is_parsed(tmp_path):
    anchor_for(tiny_llama()).save_pretrained(tmp_path)
    config_path = tmp_path / "cfp_config.json"
    config = json.loads(config_path.read_text())
    config["padding"] = "x" * MAX_CONFIG_BYTES  # valid JSON, valid fields, just too large
    config_path.write_text(json.dumps(config))
    assert config_path.stat().st_size > 2**20 >= MAX_CONFIG_BYTES
    with pytest.raises(AnchorFormatError, match="over .* bytes"):
        FisherAnchor.from_pretrained(tmp_path)


# ---------------------------------------------------------------- soak (shortened)


def _soak_module():
    spec = importlib.util.spec_from_file_location("cfp_soak", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shortened_soak_memory_flat_metrics_finite_no_fd_leak():
    result = _soak_module().soak(steps=60, warmup=20, every=10)
    assert result["finite"] and result["logs"] == 60
    assert len(result["cfp_keys"]) == 7  # 3 anchors x (sensitive, free) + total
    assert result["fd_growth"] <= 0, result
    assert result["rss_growth_mb"] < 50, result["rss"]
    assert sorted(result["rss"]) == [10, 20, 30, 40, 50, 60]
