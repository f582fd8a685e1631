"""Security rules (issue 6) read from the library's source: no pickle, every `torch.load` with
`weights_only=True`, `trust_remote_code` never turned on. (Saved and pushed anchors being
safetensors + JSON only is tested in unit/anchor/test_artifact.py.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_cfp"


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
    pattern = re.compile(
        r"^\s*(import|from)\s+(c?pickle|dill|joblib|shelve|marshal)\b|\b(c?pickle|dill|joblib)\.(loads?|dumps?)\("
    )
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path, text in _sources().items()
        for n, line in _code_lines(text)
        if pattern.search(line)
    ]
    assert not hits, "pickle-based serialisation found:\n" + "\n".join(hits)


def test_every_torch_load_uses_weights_only():
    hits = []
    for path, text in _sources().items():
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start() : text.find(")", match.start()) + 1]
            if "weights_only=True" not in re.sub(r"\s+", "", call):
                hits.append(f"{path}: {call}")
    assert not hits, "torch.load without weights_only=True:\n" + "\n".join(hits)


def test_trust_remote_code_is_never_turned_on():
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path, text in _sources().items()
        for n, line in _code_lines(text)
        if re.search(r"trust_remote_code\s*=\s*True", line)
    ]
    assert not hits, "\n".join(hits)
