"""`hf-cfp estimate`: estimate a Fisher anchor on a model's own samples and save it.

Every argument and input file is checked before the model loads (`checks`, the sampler's and the anchor
name's own validation, the prompts read), and those cheap checks before `--model`'s, which needs the
embedded model's package (the `demo` extra) when it names `smollm2-135m`; then `--device`; a Hub model id is
resolved (the cache first) as the model loads. Under `accelerate launch` each process estimates its share of the
sequences and the main process saves.
"""

from accelerate import PartialState

from ..anchor import validate_anchor_name
from ..errors import AnchorValidationError, CFPArgumentError
from ..fisher import estimate_fisher
from ..fisher.estimate_checks import check_structure
from ..fisher.sampling import Sampler
from ..loading.models import load_causal_lm
from ..loading.prompts import load_prompts
from .checks import check_output_directory, checked_kfac_rank
from .model_source import check_model_source, model_placement


def run(args) -> None:
    """Check the arguments, load the model (on `--device`, by default this process's accelerator as accelerate sees
    it, else the CPU; in `--dtype`, by default bfloat16 on a GPU and float32 elsewhere), estimate, save to `--output`
    and print the anchor's scale."""
    prompts = _checked_prompts(args)
    check_model_source(args.model)  # last: the embedded model's check needs an installed extra
    state = PartialState()  # joins the process group under `accelerate launch` / torchrun
    device, dtype = model_placement(args.device, args.dtype, state.device)
    model, tokenizer = load_causal_lm(args.model, dtype=dtype, device=device)
    anchor = estimate_fisher(
        model,
        tokenizer,
        prompts,
        num_sequences=args.num_sequences,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        name=args.name,
        estimator=args.estimator,
        engine=args.engine,
        num_samples_per_prompt=args.num_samples_per_prompt,
        scoring_tokens=args.scoring_tokens,
        structure=args.structure,
        kfac_rank=checked_kfac_rank(args),
    )
    if state.is_main_process:
        anchor.save_pretrained(args.output)
        stats = anchor.metadata["statistics"]
        print(
            f"Saved {anchor!r} to {args.output}: total mass {stats['total_mass']:.4g}, "
            f"p99 {stats['p99']:.3g}, top 1% holds {stats['top1pct_mass_share']:.1%}"
        )


def _checked_prompts(args) -> list:
    """The prompts of `--prompts`, read after the checks of `--output`, `--name`, the sampler and the structure.

    Raises:
        CFPArgumentError: the first argument at fault, named.
    """
    check_output_directory(args.output, "--output")
    try:
        validate_anchor_name(args.name)
    except AnchorValidationError as error:  # a bad argument here (exit code 2), not a bad anchor
        raise CFPArgumentError(f"--name: {error}") from None
    Sampler(args.temperature, args.top_k, args.top_p)  # its own checks of the sampler settings
    try:
        check_structure(args.structure, checked_kfac_rank(args), args.estimator)  # the rest of estimate_fisher's rule
    except CFPArgumentError as error:
        raise CFPArgumentError(f"--structure: {error}") from None
    return load_prompts(args.prompts)
