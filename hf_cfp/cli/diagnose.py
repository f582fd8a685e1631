"""`hf-cfp diagnose`: where an SFT batch's gradient lies against anchors' top-1% F, and the Fisher bound."""

import torch

from ..anchor import FisherAnchor
from ..fisher.diagnostics import diagnose_anchors
from ..loading.examples import sft_examples
from ..loading.models import load_causal_lm
from ..loading.prompts import load_pairs
from .model_source import check_model_source, model_placement


def run(args) -> None:
    """Read the pairs, check the model path (its check may need an installed extra, so after the cheap one), the
    device and dtype (`--device`, default cuda if torch sees one, else cpu; `--dtype`, default bfloat16 on a GPU,
    float32 elsewhere), and read the anchors, then load the model (`--offline`: from the cache only, like the
    anchors) and print one report per anchor (`fisher.diagnostics.diagnose_anchors`: one gradient for all of them)."""
    pairs = load_pairs(args.data)[: args.num_examples]
    check_model_source(args.model)
    default = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device, dtype = model_placement(args.device, args.dtype, default)
    anchors = [FisherAnchor.from_pretrained(ref, local_files_only=args.offline) for ref in args.anchor]
    model, tokenizer = load_causal_lm(args.model, dtype=dtype, device=device, local_files_only=args.offline)
    rows = sft_examples(tokenizer, pairs)
    ids, mask, labels = (torch.stack([row[key] for row in rows]) for key in ("input_ids", "attention_mask", "labels"))
    print(f"Model: {args.model}; SFT batch: {args.data}, {len(pairs)} (prompt, response) pairs\n")
    reports = diagnose_anchors(model, anchors, ids, labels, mask, args.batch_size)
    for reference, report in zip(args.anchor, reports, strict=True):
        print(f"{reference}\n{report.to_text()}\n")
