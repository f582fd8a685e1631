"""FisherAnchor: a capability's diagonal Fisher at theta0, with provenance, saved as safetensors + JSON."""

import json
import math
import os
import tempfile
from collections import ChainMap
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..errors import AnchorNotFoundError, AnchorValidationError
from ..geometry.diagonal.artifact import LazyFisher, check_fisher_values, fisher_shape
from ..geometry.kronecker.artifact import basis_tensors, dense_factors, kronecker_bases, split_stored, weight_shape
from ..geometry.kronecker.basis import KroneckerBasis
from ..geometry.kronecker.views import AnchorWeights, kfac_summary
from ..names import canonical_name
from .card import render_card
from .combine import combine_parts
from .config import CONFIG_NAME, FORMAT_VERSION, directory_config, validate_anchor_name
from .hub import download_anchor, looks_like_local_path, parse_reference, push_folder, safe_subfolder
from .statistics import concentration, fisher_statistics, module_type_shares
from .storage import read_tensors, stored_tensors, temporary_path, write_tensors


class FisherAnchor:
    """The output Fisher of one capability at the initial weights theta0: diagonal, or Kronecker-factored.

    F_i = E_{x ~ prompts, y ~ pi_theta0(.|x)} [ (d/dtheta_i log pi(y|x))^2 ], one float32 CPU
    tensor per parameter, keyed by canonical parameter names (wrapper prefixes removed). A K-FAC anchor
    (`structure == "kfac"`) keeps, for each of its Linear-like weights W (out x in, `kfac_names`), F_W ~ A (x) G
    as the eigenbases of A (in x in) and G (out x out) (`kfac`, `kfac_factors`), and the diagonal F of every other
    covered parameter in `fisher`.

    Args:
        fisher: parameter name -> non-negative finite tensor of the parameter's shape; or a `LazyFisher`
            (`from_pretrained(..., lazy=True)`), kept as is: its values are checked as they are read, and
            `metadata["statistics"]` stays as saved when present (else computed, streaming from the files).
        name: capability name used in metric keys (`cfp/<name>/sensitive_drift`).
        kfac: weight name -> its Kronecker factors, dense `(A, G)` (checked: finite, symmetric, positive
            semi-definite; decomposed once) or a `KroneckerBasis` (checked: orthonormal, eigenvalues >= 0); None
            (default) for a diagonal anchor.
        metadata: provenance (base model, sampler, number of sequences, prompt fingerprint...). An anchor in
            memory sets `metadata["statistics"]` and `metadata["module_types"]` (each module type's share of the
            mass, `statistics.module_type_shares`) from its tensors, replacing any given; a lazy one keeps those
            it was saved with (an anchor saved before `module_types` existed has none).

    Raises:
        AnchorValidationError: no tensors, a NaN, infinite or negative value (named with its parameter), a K-FAC
            factor that is not a finite symmetric PSD matrix, a weight given both a diagonal F and factors, or a
            name that cannot be a metric key and Hub path.
    """

    def __init__(
        self,
        fisher: Mapping[str, torch.Tensor],
        name: str = "anchor",
        metadata: Mapping | None = None,
        kfac: Mapping | None = None,
    ):
        self.name = validate_anchor_name(name)
        self.kfac: Mapping[str, KroneckerBasis] = kronecker_bases(kfac, self.name)
        if not fisher and not self.kfac:
            raise AnchorValidationError(f"Anchor {name!r} has no tensors; pass fisher={{param_name: tensor, ...}}.")
        both = sorted({canonical_name(key) for key in fisher} & set(self.kfac))
        if both:
            raise AnchorValidationError(
                f"Anchor {name!r} gives both a diagonal F and Kronecker factors for {both[:3]}"
                f"{' and more' if len(both) > 3 else ''}: one anchor has one F per weight. Keep one of them, or make "
                "the other a second anchor (several protecting anchors take the proximal map of their summed penalty)."
            )
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
        self.metadata = {
            **dict(metadata or {}),
            "statistics": self.statistics(),
            "module_types": module_type_shares(AnchorWeights(tensors, self.kfac)),
            "structure": self.structure,
            **({"kfac": kfac_summary(self.kfac)} if self.kfac else {}),
        }

    @property
    def structure(self) -> str:
        """`"kfac"` when the anchor keeps Kronecker factors for some weights, else `"diagonal"`."""
        return "kfac" if self.kfac else "diagonal"

    @property
    def kfac_names(self) -> list[str]:
        """The weights whose F is Kronecker-factored (none for a diagonal anchor)."""
        return list(self.kfac)

    def kfac_factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense factors (A, G) of K-FAC weight `name`, float32 (in x in, out x out), rebuilt from the stored
        eigenbases: Q diag(lambda) Q^T (rank-r matrices when the anchor was truncated to r eigenpairs).

        Raises:
            KeyError: `name` is not one of `kfac_names`.
        """
        if name not in self.kfac:
            raise KeyError(
                f"Anchor {self.name!r} has no Kronecker factors for {name!r}; its K-FAC weights are "
                f"kfac_names ({len(self.kfac)} of them)."
            )
        return dense_factors(self.kfac[name])

    def statistics(self) -> dict:
        """Size, scale and concentration of F (`statistics.fisher_statistics`): parameter count,
        total mass sum_i F_i, mean, max, p99, and the top 1%'s share of the mass.

        Returns:
            `dict`: the statistics by name (JSON-serializable; also stored in `metadata["statistics"]`).
        """
        return fisher_statistics(AnchorWeights(self.fisher, self.kfac))

    def concentration(self) -> dict:
        """How concentrated F's mass is (`statistics.concentration`): the share of sum_i F_i in the top 0.1 / 1 /
        5% of coordinates, and per module type. Reads every tensor (twice for the top shares)."""
        return concentration(AnchorWeights(self.fisher, self.kfac))

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

        Args:
            anchors (sequence of `FisherAnchor`): the parts, of the same base model.
            weights (sequence of `float`, *optional*): w_k, one per anchor; defaults to 1/K each.
            name (`str`, *optional*, defaults to `"combined"`): the combined anchor's name.

        Returns:
            `FisherAnchor`: the weighted sum.

        Raises:
            CFPArgumentError: no anchors, or weights of the wrong count, negative, non-finite or all 0.
            AnchorMismatchError: the parts differ in tensor names, shapes or base-model metadata.
        """
        fisher, metadata, kfac = combine_parts(anchors, weights)
        return cls(fisher, name=name, metadata=metadata, kfac=kfac)

    def save_pretrained(
        self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB", dtype: str = "float32"
    ) -> None:
        """Write the tensors (`fisher.safetensors`, or shards of at most `max_shard_size` plus
        `fisher.safetensors.index.json`, as transformers does for weights) and `cfp_config.json`.

        `dtype="bfloat16"` halves the files (values load back as float32); float16 is refused,
        Fisher values underflow in it. Tensors are written to temporary names and renamed, the
        config last, so a failed save leaves an anchor already in the directory intact.

        Args:
            save_directory (`str` or `os.PathLike`): the directory (created if missing).
            max_shard_size (`int` or `str`, *optional*, defaults to `"5GB"`): the largest tensor file, in bytes or
                as `"500MB"`.
            dtype (`str`, *optional*, defaults to `"float32"`): `"float32"` or `"bfloat16"` on disk.

        Raises:
            CFPArgumentError: an unknown or refused `dtype`, or an unreadable `max_shard_size`.
        """
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"format_version": FORMAT_VERSION, "name": self.name, "metadata": self.metadata}
        staged_config = temporary_path(directory, CONFIG_NAME)
        try:
            with open(staged_config, "x") as handle:
                json.dump(config, handle, indent=2, sort_keys=True)
            stored = ChainMap(dict(self.fisher), basis_tensors(self.kfac))  # F, then K-FAC bases under `kfac/` keys
            write_tensors(
                directory, stored, max_shard_size=max_shard_size, dtype=dtype, metadata={"cfp_anchor": self.name}
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

        A `Path`, a string naming an existing local path, or a string that looks like a path
        (`hub.looks_like_local_path`: `./x`, `../x`, `anchors/maths` beside an `anchors/` folder, `x.json`)
        is read locally and never sent to the Hub: a missing one raises AnchorNotFoundError saying that no
        such folder exists. A failed Hub lookup says which repo, revision and folder were tried, whether
        offline mode was on, and what to run.

        `lazy=True` reads only the headers: `anchor.fisher` is then a `LazyFisher` that reads a tensor, or a
        part of one (`read_flat`, `read_block`), from the files when asked and checks its values then.
        `metadata["statistics"]` and `metadata["module_types"]` are those saved with the anchor (for one saved in
        bfloat16, those of the float32 values before rounding; `anchor.statistics()` recomputes the statistics from
        the files). `CFPCallback` loads anchors this way, so that under FSDP / ZeRO-3 a process reads only the
        pieces of F it keeps.

        Args:
            repo_id_or_dir (`str` or `os.PathLike`): a directory, a repo id or a reference (above).
            subfolder (`str`, *optional*): the anchor's folder in the repo (overrides the reference's).
            revision (`str`, *optional*): branch, tag, `refs/pr/N` or commit (overrides the reference's).
            token, cache_dir, local_files_only, endpoint: as in `huggingface_hub.snapshot_download`.
            lazy (`bool`, *optional*, defaults to `False`): read tensors only when asked (above).

        Returns:
            `FisherAnchor`: the anchor, with `metadata["hub"]` when it came from the Hub.

        Raises:
            AnchorNotFoundError: no anchor at that directory, repo, revision or subfolder.
            AnchorFormatError: a corrupt, truncated or unknown-version anchor.
            AnchorValidationError: a bad value (NaN, infinite, negative) or an unsafe subfolder.
            CFPHubError: the Hub refused or failed the download.
        """
        reference = os.fspath(repo_id_or_dir)
        local = Path(reference) / (subfolder or "")
        if not isinstance(repo_id_or_dir, str) or os.path.lexists(reference) or looks_like_local_path(reference):
            return cls._load_directory(local, lazy)
        repo_id, ref_revision, ref_subfolder = parse_reference(reference)
        subfolder = safe_subfolder(subfolder if subfolder is not None else ref_subfolder)
        revision = revision or ref_revision
        try:
            directory, commit = download_anchor(
                repo_id,
                subfolder,
                revision,
                token=token,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                endpoint=endpoint,
            )
        except AnchorNotFoundError as error:
            raise AnchorNotFoundError(f"No local folder {reference!r} exists. {error}") from error
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
        config = directory_config(directory)
        name, metadata = config["name"], config.get("metadata")
        if lazy:
            fisher, bases = split_stored(stored_tensors(directory), name, lazy=True)
            return cls(LazyFisher(fisher, name), name=name, metadata=metadata, kfac=bases)
        fisher, bases = split_stored(read_tensors(directory), name, lazy=False)
        return cls(fisher, name=name, metadata=metadata, kfac=bases)

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
        and `dtype` are those of `save_pretrained`.

        Args:
            repo_id (`str`): the target repo (`org/model`), created if missing.
            path_in_repo (`str`, *optional*): the folder in the repo; defaults to `cfp/<name>`.
            revision (`str`, *optional*): the branch to commit to.
            create_pr (`bool`, *optional*, defaults to `False`): open a pull request instead of committing.
            commit_message (`str`, *optional*): defaults to "Add CFP Fisher anchor '<name>'".
            private (`bool`, *optional*): visibility of a repo this creates.
            token, endpoint: as in `huggingface_hub.HfApi`.
            max_shard_size, dtype: as in `save_pretrained`.

        Returns:
            `huggingface_hub.CommitInfo`: the commit (or pull request) made.

        Raises:
            AnchorValidationError: an unsafe `path_in_repo`.
            CFPHubError: the Hub refused or failed the upload (nothing is changed remotely).
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
        if self.kfac:
            count += sum(math.prod(weight_shape(self.kfac, name)) for name in self.kfac)
            return (
                f"FisherAnchor(name={self.name!r}, structure='kfac', kfac_weights={len(self.kfac)}, "
                f"tensors={len(self.fisher)}, coordinates={count})"
            )
        return f"FisherAnchor(name={self.name!r}, tensors={len(self.fisher)}, coordinates={count})"
