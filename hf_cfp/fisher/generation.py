"""`model.generate` set up to draw from the sampler's mu and nothing else (`sampling.sample_with_supports` runs it).

generate fills every setting left None in the `GenerationConfig` it is given from the model's own generation
config, then from transformers' defaults (top_k=50 among them), and it appends its own warpers after the logits
processors it is given. So `generation_config` gives every setting that shapes the distribution, with generate's
own warpers off (mu's come as processors, `Sampler.warpers`, followed by the `SupportRecorder`, which then sees
the scores generate draws from), and `check_generation_config` refuses a model whose generation config sets one
of the settings that only None turns off. `seeded_rng` gives generate's `torch.multinomial` a random state
seeded from a batch's own stream.
"""

import contextlib
from collections.abc import Callable, Collection, Iterator

import torch
from transformers import GenerationConfig, LogitsProcessor

from ..errors import CFPArgumentError

# generate fills every setting left None in the config it is given from the model's own generation config; these
# change the distribution or the end of a response, and None is their only "off" (transformers 5).
UNSETTABLE_GENERATION_SETTINGS = (
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "min_p",
    "top_h",
    "watermarking_config",
    "dola_layers",
    "constraints",
    "force_words_ids",
    "prompt_lookup_num_tokens",
    "assistant_early_exit",
    "stop_strings",
    "max_time",
)


def check_generation_config(model) -> None:
    """CFPArgumentError when `model` has no `generate`, or when its generation config sets one of
    `UNSETTABLE_GENERATION_SETTINGS`, which generate would add to the sampler's mu."""
    if not callable(getattr(model, "generate", None)):
        raise CFPArgumentError(
            f"{type(model).__name__} has no generate(): on-policy sampling runs model.generate (ancestral sampling "
            "with a KV cache); use a causal LM of transformers, e.g. an AutoModelForCausalLM."
        )
    own = getattr(model, "generation_config", None)
    found = {
        name: getattr(own, name) for name in UNSETTABLE_GENERATION_SETTINGS if getattr(own, name, None) is not None
    }
    if found:
        raise CFPArgumentError(
            f"model.generation_config sets {found}: generate would apply it on top of the sampler, so the responses "
            "would not be drawn from the distribution they are scored under. Set it to None on "
            "model.generation_config for the estimate."
        )


def generation_config(max_new_tokens: int, eos_ids: Collection[int], pad_id: int) -> GenerationConfig:
    """generate's settings for drawing from mu, each given (generate fills a None from the model's own config):
    ancestral sampling of one sequence per prompt with no warper of generate's own (temperature 1, top_k 0, top_p
    1, typical_p 1, no epsilon or eta cutoff: mu's warpers come as logits processors, `Sampler.warpers`), no
    repetition penalty or n-gram ban, no minimum length, at most `max_new_tokens` tokens, ending at the first of
    `eos_ids` (none: fixed length), later positions filled with `pad_id`."""
    return GenerationConfig(
        do_sample=True,
        num_beams=1,
        num_return_sequences=1,
        use_mtp=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,  # min_length follows from it (generate sets it to the prompt width + min_new_tokens)
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        guidance_scale=1.0,
        renormalize_logits=False,
        remove_invalid_values=False,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
        return_dict_in_generate=False,
    )


class SupportRecorder(LogitsProcessor):
    """The last logits processor: it sees the scores generate draws the next tokens from (softmax(scores) = mu)
    and returns them unchanged. With `keep`, it keeps keep(S) for each step's support S = {a : scores_a > -inf}
    (on the scores' device; `sampling.pack_support` packs it); with `on_step`, it calls `on_step(k)` at each step,
    k the number of responses that get a token there (those that have not drawn one of `eos_ids` after the first
    `prompt_width` positions)."""

    def __init__(
        self,
        prompt_width: int,
        eos_ids: torch.Tensor,
        keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_step: Callable[[int], object] | None = None,
    ):
        self.prompt_width, self.eos_ids, self.keep, self.on_step = prompt_width, eos_ids, keep, on_step
        self.supports: list[torch.Tensor] = []
        self.ended: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.keep is not None:
            self.supports.append(self.keep(scores > float("-inf")))
        if self.on_step is not None:
            if self.ended is None:
                self.ended = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
            if input_ids.shape[1] > self.prompt_width:
                self.ended |= torch.isin(input_ids[:, -1], self.eos_ids)
            growing = int((~self.ended).sum())
            if growing:
                self.on_step(growing)
        return scores


@contextlib.contextmanager
def seeded_rng(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """Inside: the global random state of the CPU and of `device` (what generate's `torch.multinomial` draws
    from) seeded with s = one draw of `generator` in [0, 2^62); after: restored as it was (`torch.random.fork_rng`)."""
    seed = int(torch.randint(2**62, (), generator=generator, device=generator.device))
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else getattr(module, "current_device", lambda: 0)()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        generators = getattr(module, "default_generators", None)  # one per device (CUDA, XPU); MPS: one device
        (generators[index] if generators else module).manual_seed(seed)
        yield


def until_eos(tokens: list[int], eos_ids: Collection[int]) -> list[int]:
    """`tokens` up to and including the first of `eos_ids` (all of them when none occurs)."""
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: position + 1]
    return tokens
