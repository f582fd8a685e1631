"""`python -m hf_cfp.cli ...` (and `accelerate launch -m hf_cfp.cli ...`): the `hf-cfp` command."""

from . import main

if __name__ == "__main__":  # importing the module (the docs build inspects every module) runs nothing
    main()
