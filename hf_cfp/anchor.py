"""FisherAnchor: a capability's diagonal Fisher at theta0, with provenance, saved as safetensors + JSON."""

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .drift import free_threshold
from .errors import AnchorFormatError, AnchorNotFoundError, AnchorValidationError
from .names import canonical_name

FORMAT_VERSION = 1
CONFIG_NAME = "cfp_config.json"
WEIGHTS_NAME = "fisher.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_anchor_name(name: str) -> str:
    """Anchor names become metric keys and Hub paths: letters, digits, `_`, `.`, `-`; no `..`."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise AnchorValidationError(
            f"Anchor name {name!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit and without '..' (e.g. 'math', 'code-v2')."
        )
    return name


def _validate_values(name: str, tensor: torch.Tensor, anchor_name: str) -> None:
    bad = ~torch.isfinite(tensor)
    if bad.any():
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: parameter {name!r} has {int(bad.sum())} NaN/Inf Fisher values. "
            "The anchor is corrupt or its estimation overflowed; re-estimate it (in float32)."
        )
    negative = tensor < 0
    if negative.any():
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: parameter {name!r} has {int(negative.sum())} negative Fisher values "
            f"(min {float(tensor.min()):.3g}). A diagonal Fisher is a mean of squares; re-estimate the anchor."
        )


class FisherAnchor:
    """The diagonal output Fisher of one capability at the initial weights theta0.

    F_i = E_{x ~ prompts, y ~ pi_theta0(.|x)} [ (d/dtheta_i log pi(y|x))^2 ], one float32 CPU
    tensor per parameter, keyed by canonical parameter names (wrapper prefixes removed).

    Args:
        fisher: parameter name -> non-negative finite tensor of the parameter's shape.
        name: capability name used in metric keys (`cfp/<name>/sensitive_drift`).
        metadata: provenance (base model, sampler, number of sequences, prompt fingerprint...).
    """

    def __init__(self, fisher: Mapping[str, torch.Tensor], name: str = "anchor", metadata: Mapping | None = None):
        self.name = validate_anchor_name(name)
        if not fisher:
            raise AnchorValidationError(f"Anchor {name!r} has no tensors; pass fisher={{param_name: tensor, ...}}.")
        self.fisher = {}
        for key, tensor in fisher.items():
            tensor = torch.as_tensor(tensor).detach().to(device="cpu", dtype=torch.float32).contiguous()
            _validate_values(key, tensor, name)
            self.fisher[canonical_name(key)] = tensor
        self.metadata = {**dict(metadata or {}), "statistics": self.statistics()}

    def statistics(self) -> dict:
        """Size, scale and concentration of F: parameter count, total mass sum_i F_i, mean, max,
        the 99th percentile `p99` (lam = 1 / p99 halves every top-1% coordinate's displacement
        per step), and the share of the mass held by the top 1% of coordinates."""
        flat = torch.cat([t.reshape(-1) for t in self.fisher.values()]).double()
        total = float(flat.sum())
        top = flat.topk(max(1, math.ceil(0.01 * flat.numel()))).values
        return {
            "num_parameters": flat.numel(),
            "total_mass": total,
            "mean": total / flat.numel(),
            "max": float(flat.max()),
            "p99": free_threshold([flat], 0.99),
            "top1pct_mass_share": float(top.sum()) / total if total > 0 else 0.0,
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write `fisher.safetensors` and `cfp_config.json` into `save_directory`.

        Files are written to temporary names first and renamed, so a failure leaves an
        anchor already in the directory intact.
        """
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"format_version": FORMAT_VERSION, "name": self.name, "metadata": self.metadata}
        text = json.dumps(config, indent=2, sort_keys=True)
        staged = []
        try:
            for filename, write in (
                (WEIGHTS_NAME, lambda path: save_file(self.fisher, path, metadata={"format": "pt", "cfp_anchor": self.name})),
                (CONFIG_NAME, lambda path: Path(path).write_text(text)),
            ):
                fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{filename}.")
                os.close(fd)
                staged.append((tmp, directory / filename))
                write(tmp)
            for tmp, final in staged:
                os.replace(tmp, final)
        finally:
            for tmp, _ in staged:
                if os.path.exists(tmp):
                    os.remove(tmp)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "FisherAnchor":
        """Load an anchor saved by `save_pretrained`, validating the format and every value."""
        directory = Path(path)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if not directory.is_dir():
            raise AnchorNotFoundError(f"No anchor directory at {str(directory)!r}; save one with anchor.save_pretrained().")
        for required in (config_path, weights_path):
            if not required.is_file():
                raise AnchorNotFoundError(f"{str(directory)!r} is not an anchor: {required.name} is missing.")
        config = _read_config(config_path)
        try:
            fisher = load_file(weights_path)
        except (SafetensorError, OSError, ValueError) as error:
            raise AnchorFormatError(
                f"{str(weights_path)!r} is truncated or corrupt ({error}); download or re-save the anchor."
            ) from error
        return cls(fisher, name=config["name"], metadata=config.get("metadata"))

    def __repr__(self) -> str:
        count = sum(t.numel() for t in self.fisher.values())
        return f"FisherAnchor(name={self.name!r}, tensors={len(self.fisher)}, coordinates={count})"


def _read_config(path: Path) -> dict:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AnchorFormatError(f"{str(path)!r} is over {MAX_CONFIG_BYTES} bytes; an anchor config is small JSON.")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AnchorFormatError(f"{str(path)!r} is not valid JSON ({error}); re-save the anchor.") from error
    if not isinstance(config, dict) or "name" not in config or "format_version" not in config:
        raise AnchorFormatError(f"{str(path)!r} lacks 'name' or 'format_version'; it was not written by hf-cfp.")
    if config["format_version"] != FORMAT_VERSION:
        raise AnchorFormatError(
            f"{str(path)!r} has format_version {config['format_version']!r}; this hf-cfp reads version "
            f"{FORMAT_VERSION}. Upgrade hf-cfp or re-save the anchor."
        )
    return config
