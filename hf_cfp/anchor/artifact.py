"""FisherAnchor: a capability's diagonal Fisher at theta0, with provenance, saved as safetensors + JSON."""

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..errors import AnchorFormatError, AnchorNotFoundError, AnchorValidationError
from ..names import canonical_name
from .card import render_card
from .combine import combine_parts
from .hub import download_anchor, names_a_local_path, parse_reference, push_folder, safe_subfolder
from .lazy import LazyFisher, fisher_shape
from .statistics import fisher_statistics
from .storage import read_tensors, stored_tensors, write_tensors
from .values import check_fisher_values

FORMAT_VERSION = 1
CONFIG_NAME = "cfp_config.json"
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


class FisherAnchor:
    """The diagonal output Fisher of one capability at the initial weights theta0.

    F_i = E_{x ~ prompts, y ~ pi_theta0(.|x)} [ (d/dtheta_i log pi(y|x))^2 ], one float32 CPU
    tensor per parameter, keyed by canonical parameter names (wrapper prefixes removed).

    Args:
        fisher: parameter name -> non-negative finite tensor of the parameter's shape; or a `LazyFisher`
            (`from_pretrained(..., lazy=True)`), kept as is: its values are checked as they are read, and
            `metadata["statistics"]` stays as saved when present (else computed, streaming from the files).
        name: capability name used in metric keys (`cfp/<name>/sensitive_drift`).
        metadata: provenance (base model, sampler, number of sequences, prompt fingerprint...).
    """

    def __init__(self, fisher: Mapping[str, torch.Tensor], name: str = "anchor", metadata: Mapping | None = None):
        self.name = validate_anchor_name(name)
        if not fisher:
            raise AnchorValidationError(f"Anchor {name!r} has no tensors; pass fisher={{param_name: tensor, ...}}.")
        self.fisher: Mapping[str, torch.Tensor]
        if isinstance(fisher, LazyFisher):
            self.fisher = fisher
            saved = dict(metadata or {})
            self.metadata = {**saved, "statistics": saved.get("statistics") or self.statistics()}
            return
        tensors = {}
        for key, tensor in fisher.items():
            tensor = torch.as_tensor(tensor).detach().to(device="cpu", dtype=torch.float32).contiguous()
            check_fisher_values(key, tensor, name)
            tensors[canonical_name(key)] = tensor
        self.fisher = tensors
        self.metadata = {**dict(metadata or {}), "statistics": self.statistics()}

    def statistics(self) -> dict:
        """Size, scale and concentration of F (`statistics.fisher_statistics`): parameter count,
        total mass sum_i F_i, mean, max, p99, and the top 1%'s share of the mass."""
        return fisher_statistics(self.fisher)

    @classmethod
    def combine(
        cls, anchors: Sequence["FisherAnchor"], weights: Sequence[float] | None = None, name: str = "combined"
    ) -> "FisherAnchor":
        """One anchor from K anchors of the same base model: F = sum_k w_k F_k, elementwise, summed in
        float64 and stored in float32. The default weights w_k = 1/K give the mean (the anchor of all the
        parts' sequences together when the parts have equally many); weights must be finite and >= 0,
        one per anchor, not all 0.

        Every part must cover the same tensor names and shapes and carry the same base-model metadata
        (`base_model`, `base_model_revision`, `base_fingerprint`), else AnchorMismatchError names the
        first difference. The result keeps those entries and lists its parts in
        `metadata["combined_from"]`: `{"name", "weight", "reference"}` each, the reference being
        `org/model@commit:subfolder` for a part loaded from the Hub and None otherwise (a local path
        is not recorded, so that it never reaches a pushed anchor). Statistics are recomputed.
        """
        fisher, metadata = combine_parts(anchors, weights)
        return cls(fisher, name=name, metadata=metadata)

    def save_pretrained(
        self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB", dtype: str = "float32"
    ) -> None:
        """Write the tensors (`fisher.safetensors`, or shards of at most `max_shard_size` plus
        `fisher.safetensors.index.json`, as transformers does for weights) and `cfp_config.json`.

        `dtype="bfloat16"` halves the files (values load back as float32); float16 is refused,
        Fisher values underflow in it. Tensors are written to temporary names and renamed, the
        config last, so a failed save leaves an anchor already in the directory intact.
        """
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"format_version": FORMAT_VERSION, "name": self.name, "metadata": self.metadata}
        fd, staged_config = tempfile.mkstemp(dir=directory, prefix=f".{CONFIG_NAME}.")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(config, handle, indent=2, sort_keys=True)
            write_tensors(
                directory, self.fisher, max_shard_size=max_shard_size, dtype=dtype, metadata={"cfp_anchor": self.name}
            )
            os.replace(staged_config, directory / CONFIG_NAME)
        finally:
            if os.path.exists(staged_config):
                os.remove(staged_config)

    @classmethod
    def from_pretrained(
        cls,
        repo_id_or_dir: str | os.PathLike,
        subfolder: str | None = None,
        revision: str | None = None,
        token=None,
        cache_dir=None,
        local_files_only: bool = False,
        endpoint: str | None = None,
        lazy: bool = False,
    ) -> "FisherAnchor":
        """Load an anchor from a local directory or a Hub repo, validating the format and every value.

        `repo_id_or_dir` is a directory written by `save_pretrained`, a repo id (`org/model`,
        with `subfolder="cfp/math"`), or a reference `org/model@revision:cfp/math`. From the Hub
        only that subfolder's files are downloaded, at `revision` (branch, tag, `refs/pr/N` or
        commit sha; default main), and the resolved commit is recorded in `metadata["hub"]`.
        Works offline from the cache (`local_files_only=True` or HF_HUB_OFFLINE=1).

        `lazy=True` reads only the headers: `anchor.fisher` is then a `LazyFisher` that reads a tensor, or a
        part of one (`read_flat`, `read_block`), from the files when asked and checks its values then.
        `metadata["statistics"]` are those saved with the anchor (for one saved in bfloat16, those of the
        float32 values before rounding; `anchor.statistics()` recomputes them from the files). `CFPCallback`
        loads anchors this way, so that under FSDP / ZeRO-3 a process reads only the pieces of F it keeps.
        """
        local = Path(repo_id_or_dir) / (subfolder or "")
        if local.is_dir() or names_a_local_path(str(repo_id_or_dir)):
            return cls._load_directory(local, lazy)
        repo_id, ref_revision, ref_subfolder = parse_reference(str(repo_id_or_dir))
        subfolder = safe_subfolder(subfolder if subfolder is not None else ref_subfolder)
        revision = revision or ref_revision
        directory, commit = download_anchor(
            repo_id,
            subfolder,
            revision,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            endpoint=endpoint,
        )
        anchor = cls._load_directory(directory, lazy)
        anchor.metadata["hub"] = {
            "repo_id": repo_id,
            "subfolder": subfolder,
            "revision": revision or "main",
            "commit": commit,
        }
        return anchor

    @classmethod
    def _load_directory(cls, directory: Path, lazy: bool) -> "FisherAnchor":
        if not directory.is_dir():
            raise AnchorNotFoundError(
                f"No anchor directory at {str(directory)!r}; save one with anchor.save_pretrained()."
            )
        if not (directory / CONFIG_NAME).is_file():
            raise AnchorNotFoundError(f"{str(directory)!r} is not an anchor: {CONFIG_NAME} is missing.")
        config = _read_config(directory / CONFIG_NAME)
        name, metadata = config["name"], config.get("metadata")
        if lazy:
            return cls(LazyFisher(stored_tensors(directory), name), name=name, metadata=metadata)
        return cls(read_tensors(directory), name=name, metadata=metadata)

    def push_to_hub(
        self,
        repo_id: str,
        path_in_repo: str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        commit_message: str | None = None,
        private: bool | None = None,
        token=None,
        endpoint: str | None = None,
        max_shard_size: int | str = "5GB",
        dtype: str = "float32",
    ):
        """Upload the anchor (tensors, `cfp_config.json`, a model card `README.md`) to
        `repo_id/path_in_repo` (default `cfp/<name>`) in one commit, creating the repo if needed.

        Push into the base model's own repo (typically `create_pr=True`) or a separate anchors
        repo; the card's metadata links the base model (`base_model:`) and carries the tags
        `cfp` and `fisher-anchor`. A failed push leaves the remote unchanged. `max_shard_size`
        and `dtype` are those of `save_pretrained`. Returns the CommitInfo.
        """
        path_in_repo = safe_subfolder(path_in_repo or f"cfp/{self.name}")
        with tempfile.TemporaryDirectory(prefix="hf-cfp-push-") as staging:
            self.save_pretrained(staging, max_shard_size=max_shard_size, dtype=dtype)
            reference = f"{repo_id}:{path_in_repo}"
            render_card(self, reference).save(Path(staging) / "README.md")
            return push_folder(
                Path(staging),
                repo_id,
                path_in_repo,
                revision=revision,
                create_pr=create_pr,
                commit_message=commit_message or f"Add CFP Fisher anchor '{self.name}'",
                private=private,
                token=token,
                endpoint=endpoint,
            )

    def __repr__(self) -> str:
        count = sum(fisher_shape(self.fisher, name).numel() for name in self.fisher)
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
