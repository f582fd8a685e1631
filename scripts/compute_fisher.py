"""Estimate a Fisher anchor: `hf-cfp estimate` as a script, for `accelerate launch`.

python scripts/compute_fisher.py --model smollm2-135m --prompts math --output anchors/math
accelerate launch --num_processes 4 scripts/compute_fisher.py --model ./my-model \\
    --prompts prompts.jsonl --output anchors/math
"""

import sys

from hf_cfp.cli import main

if __name__ == "__main__":
    main(["estimate", *sys.argv[1:]])
