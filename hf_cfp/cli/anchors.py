"""The commands that load saved anchors whole: `pull`, `push`, `compare` (no model is loaded)."""

from ..anchor import FisherAnchor
from ..anchor.compare import compare_anchors
from .checks import check_anchor_directory, check_output_directory


def pull(args) -> None:
    """Download an anchor's files at a revision (into the Hub cache), optionally saving a copy to `--output`."""
    if args.output:
        check_output_directory(args.output, "--output")
    anchor = FisherAnchor.from_pretrained(args.anchor, revision=args.revision, local_files_only=args.offline)
    if args.output:
        anchor.save_pretrained(args.output)
    hub = anchor.metadata.get("hub", {})
    print(
        f"{anchor!r} at commit {hub.get('commit')}"
        + (f", saved to {args.output}" if args.output else " (in the cache)")
    )


def push(args) -> None:
    """Upload a saved anchor directory to `repo_id` in one commit, with a model card."""
    check_anchor_directory(args.anchor)
    anchor = FisherAnchor.from_pretrained(args.anchor)
    info = anchor.push_to_hub(
        args.repo_id,
        path_in_repo=args.path_in_repo,
        revision=args.revision,
        create_pr=args.create_pr,
        private=args.private or None,
    )
    print(
        f"Pushed {anchor!r} to {args.repo_id}: {getattr(info, 'commit_url', info)}"
        + (f" (pull request {info.pr_url})" if getattr(info, "pr_url", None) else "")
    )


def compare(args) -> None:
    """Print `compare_anchors` of two anchors: top-set overlaps, cosine, mass per module type (for two K-FAC anchors
    over the diagonal of A (x) G, then the factors' mean cosines)."""
    a, b = (FisherAnchor.from_pretrained(ref, local_files_only=args.offline) for ref in (args.a, args.b))
    result = compare_anchors(a, b)
    width = max([len(row["type"]) for row in result["module_types"]] + [30]) + 2
    print(f"A: {args.a} (anchor {a.name!r})\nB: {args.b} (anchor {b.name!r})")
    print(f"{result['num_parameters']:,} coordinates\n\ntop-set overlap |T(A) & T(B)| / |T|")
    for label, overlap in result["top_overlap"].items():
        print(f"{'  top ' + label:<{width}}{overlap:>18.4f}")
    print(
        f"{'cosine(F_A, F_B)':<{width}}{result['cosine']:>18.6f}\n\n{'module type':<{width}}{'A mass':>9}{'B mass':>9}"
    )
    for row in result["module_types"]:
        print(f"{row['type']:<{width}}{row['share_a']:>9.2%}{row['share_b']:>9.2%}")
    if "factor_cosine" in result:  # two K-FAC anchors: compared on the diagonal of A (x) G, and factor by factor
        cosines = result["factor_cosine"]
        print(
            f"\nK-FAC factors, mean over weights: cosine(A_A, A_B) {cosines['A']:.6f}, "
            f"cosine(G_A, G_B) {cosines['G']:.6f}"
        )
