"""`python -m hf_cfp.cli ...` (and `accelerate launch -m hf_cfp.cli ...`): the `hf-cfp` command."""

from . import main

main()
