"""What the long run runs (issue 31): the arms, in the order that decides the most first, and the sizes of the
tiny and the embedded plan.

An arm is `evidence.plan.Arm` (optimizer, method, strength, seed, anchor). Optimizers: `sft` (transformers' Trainer
on the pirate answers), `dpo` (TRL, the pirate answer chosen over the plain one), `grpo-<reward>` (TRL's GRPOTrainer
on the training prompts with a reward of `evidence.rewards.REWARDS`: `pirate`, the lexicon share, off every
capability; `brevity`, which overlaps them). Methods and their strength:

- `unregularized` (0); `kl`: the KL penalty to the base, beta (SFT: `KLPenaltySFTTrainer`; DPO and GRPO: their own
  beta); `lwf`: learning without forgetting, beta * KL(p0 || p_theta) on the math anchor's calibration sequences
  (`baselines.Distillation`); `isotropic`: the pull toward theta0 with F replaced by its mean (L2 toward the base),
  lam = c / p99(F_math); `cfp`: diagonal CFP [math], lam = c / p99(F_math); `kfac`: CFP-KFAC with the anchor
  `math` (full rank) or the default truncation (`Plan.default_kfac`, `math_t256`), lam = c / p99 of the full anchor
  (c: `Plan.cfp_strengths_of`, on DPO its own `dpo_cfp_strengths` where given);
- `kfac_summed` (with `Plan.summed`): CFP-KFAC protecting with several anchors at once, the exact proximal map of
  their summed penalty; the label `math+safety_t256` (`summed_labels`) names the math and safety anchors of that
  truncation, each lam_k = c / p99 of its own full anchor. One anchor for both, estimated on the math and safety
  calibration sequences together, is a `kfac` arm with the union's label (`mathsafety_t256`, the evidence plan's
  `kfac_union`);
- `wiseft`: no training, theta0 + a (theta_T - theta0) of the unregularized run of the same optimizer and seed,
  a = strength; `lora`: LoRA r = `lora_rank` on the attention and MLP projections (0); `lora_kfac`: the same with
  CFP-KFAC [default truncation] at c = strength.

Order (`Plan.arms`): per optimizer of `optimizers`, the unregularized run, its WiSE-FT points, and every method at
its first strength (the table rows); then the GRPO table rows of the first seed (pirate first); then the other
strengths; then the other GRPO seeds and rewards. An interrupted run keeps the comparison at one strength first.

With `Plan.behaviour` (issue 50, `Plan.behaviour_arms`) the order answers the behavioural questions first: SFT and
DPO seed 0 for the unregularized run, the KL penalty, LwF, the isotropic pull and both CFP-KFAC arms at their first
strength; then several capabilities protected at once under SFT and GRPO with the brevity reward (seeds 0 and 1,
c of `kfac_strengths`): the union anchor, math alone, and each seed's unregularized run; then the second seed of
SFT and DPO, every method at both strengths; then the rest (seed 0's other arms and strengths, a third GRPO seed
for the arms of `third_seed_arms`); last the summed-penalty arms (`summed`), whose correction costs hundreds of
times one anchor's on this CPU (docs/reports/performance.md, runs S and U).
"""

from dataclasses import dataclass, replace

from evidence.plan import EMBEDDED as EVIDENCE_EMBEDDED
from evidence.plan import TINY as EVIDENCE_TINY
from evidence.plan import Arm, kfac_anchor_name, kfac_lam_anchor
from evidence.plan import Plan as EvidencePlan

SUPERVISED = ("sft", "dpo")
GRPO_PREFIX = "grpo-"
TRAINED_METHODS = ("unregularized", "kl", "lwf", "isotropic", "cfp", "kfac", "kfac_summed", "lora", "lora_kfac")
BEHAVIOUR_FIRST = ("unregularized", "kl", "lwf", "isotropic", "kfac")  # seed 0's first block (module docstring)


def summed_labels(label: str) -> list[str]:
    """The K-FAC labels a `kfac_summed` label protects with: `math+safety_t256` -> [`math_t256`, `safety_t256`]."""
    domains, _, variant = label.partition("_")
    return [f"{domain}_{variant}" if variant else domain for domain in domains.split("+")]


def grpo_reward(optimizer: str) -> str | None:
    """The reward of a GRPO optimizer name (`grpo-pirate` -> `pirate`), None for SFT and DPO."""
    return optimizer[len(GRPO_PREFIX) :] if optimizer.startswith(GRPO_PREFIX) else None


@dataclass(frozen=True)
class Plan:
    """Sizes of one long run (see `TINY` and `EMBEDDED`); `anchors` is the evidence plan whose anchors (math, code,
    safety; diagonal and K-FAC; the default truncation; isotropic) it uses, made or reused by `AnchorStore`."""

    anchors: EvidencePlan
    steps: int
    points: int  # measurements along a run, every steps // points steps (the last at the end)
    batch_size: int
    dpo_batch_size: int
    sft_learning_rate: float
    dpo_learning_rate: float
    dpo_beta: float
    task_prompts: int  # training prompts of the task (the rest of `data.generic_prompts` held out)
    heldout_prompts: int  # held-out prompts scored for task progress
    task_new_tokens: int
    math_items: int
    math_new_tokens: int
    kl_prompts: int  # held-out prompts per capability, kl_samples responses each (curves: the first response only)
    kl_samples: int
    kl_new_tokens: int
    sft_kl_betas: tuple[float, ...]
    dpo_kl_betas: tuple[float, ...]
    lwf_betas: tuple[float, ...]
    isotropic_strengths: tuple[float, ...]
    cfp_strengths: tuple[float, ...]
    kfac_strengths: tuple[float, ...]
    dpo_cfp_strengths: tuple[float, ...]  # c of diagonal and K-FAC CFP on DPO; empty: as on SFT and GRPO
    wiseft_alphas: tuple[float, ...]
    lora_rank: int
    lora_learning_rate: float
    seeds: tuple[int, ...] = (0,)
    grpo_rewards: tuple[str, ...] = ("pirate", "brevity")
    grpo_seeds: tuple[int, ...] = (0, 1)
    grpo_steps: int = 64
    grpo_learning_rate: float = 1e-5
    grpo_kl_betas: tuple[float, ...] = (0.05, 0.5)
    grpo_batch_size: int = 8  # completions per step
    grpo_generations: int = 4  # completions per prompt
    grpo_completion_tokens: int = 24
    grpo_eval_prompts: int = 32  # held-out prompts for the trained model's reward, grpo_eval_samples each
    grpo_eval_samples: int = 2
    behaviour: bool = False  # the behavioural measure and order (module docstring)
    behaviour_samples: int = 2  # sampled completions per held-out prompt, besides the greedy one
    several_optimizers: tuple[str, ...] = ()  # where several capabilities are protected at once
    summed: str | None = None  # the kfac_summed label, e.g. math+safety_t256
    union: str | None = None  # the union anchor's kfac label, e.g. mathsafety_t256
    third_seed_arms: tuple[tuple[str, str, float, str | None], ...] = ()  # (optimizer, method, c, anchor), seed 2

    @property
    def optimizers(self) -> tuple[str, ...]:
        return SUPERVISED + tuple(GRPO_PREFIX + reward for reward in self.grpo_rewards)

    @property
    def default_kfac(self) -> str:
        """The default truncation's label, e.g. `math_t256` (the evidence plan's `kfac_default`)."""
        return str(self.anchors.kfac_default)

    def steps_of(self, optimizer: str) -> int:
        return self.grpo_steps if grpo_reward(optimizer) else self.steps

    def measured_steps(self, optimizer: str) -> list[int]:
        """The steps a run is measured at: every steps // points, the last being the final step."""
        steps = self.steps_of(optimizer)
        every = max(1, steps // self.points)
        return sorted({*range(every, steps + 1, every), steps})

    def kl_betas(self, optimizer: str) -> tuple[float, ...]:
        return {"sft": self.sft_kl_betas, "dpo": self.dpo_kl_betas}.get(optimizer, self.grpo_kl_betas)

    def cfp_strengths_of(self, optimizer: str, method: str) -> tuple[float, ...]:
        """c of diagonal (`cfp`) or K-FAC (`kfac`) CFP on `optimizer`: `dpo_cfp_strengths` on DPO where given,
        else `cfp_strengths` or `kfac_strengths`."""
        if optimizer == "dpo" and self.dpo_cfp_strengths:
            return self.dpo_cfp_strengths
        return self.cfp_strengths if method == "cfp" else self.kfac_strengths

    def sweeps(self, optimizer: str) -> list[tuple[str, str | None, tuple[float, ...]]]:
        """(method, anchor, strengths) of every trained method but the unregularized run, in table order."""
        methods = [
            ("kl", None, self.kl_betas(optimizer)),
            ("isotropic", "math", self.isotropic_strengths),
            ("cfp", "math", self.cfp_strengths_of(optimizer, "cfp")),
            ("kfac", "math", self.cfp_strengths_of(optimizer, "kfac")),
            ("kfac", self.default_kfac, self.cfp_strengths_of(optimizer, "kfac")),
        ]
        if grpo_reward(optimizer) is None:
            methods += [
                ("lwf", "math", self.lwf_betas),
                ("lora", None, (0.0,)),
                ("lora_kfac", self.default_kfac, self.kfac_strengths[:1]),
            ]
        return methods

    def runs(self, optimizer: str, seed: int, first: bool) -> list[Arm]:
        """The arms of one optimizer and seed: with `first`, the unregularized run, its WiSE-FT points and every
        method's first strength; otherwise every method's other strengths."""
        arms = [Arm(optimizer, "unregularized", 0.0, seed)] if first else []
        if first and grpo_reward(optimizer) is None:
            arms += [Arm(optimizer, "wiseft", a, seed) for a in self.wiseft_alphas]
        for method, anchor, strengths in self.sweeps(optimizer):
            chosen = strengths[:1] if first else strengths[1:]
            arms += [Arm(optimizer, method, s, seed, anchor) for s in chosen]
        return arms

    def arms(self) -> list[Arm]:
        """Every arm, in the module docstring's order."""
        if self.behaviour:
            return self.behaviour_arms()
        grpo = [o for o in self.optimizers if grpo_reward(o)]
        main, rest = grpo[:1], grpo[1:]
        first_seed, *other_seeds = self.grpo_seeds
        arms = [arm for o in SUPERVISED for s in self.seeds for arm in self.runs(o, s, True)]
        arms += [arm for o in main for arm in self.runs(o, first_seed, True)]
        arms += [arm for o in SUPERVISED for s in self.seeds for arm in self.runs(o, s, False)]
        arms += [arm for o in main for arm in self.runs(o, first_seed, False)]
        both = (True, False)
        arms += [arm for o in main for s in other_seeds for first in both for arm in self.runs(o, s, first)]
        arms += [arm for o in rest for s in self.grpo_seeds for first in both for arm in self.runs(o, s, first)]
        return arms

    def several_runs(self, seed: int) -> list[Arm]:
        """Several capabilities at once (module docstring), without the summed arms: per optimizer of
        `several_optimizers`, the unregularized run, then at every c of `kfac_strengths` the union anchor and math
        alone."""
        arms = []
        for optimizer in self.several_optimizers:
            arms.append(Arm(optimizer, "unregularized", 0.0, seed))
            for c in self.kfac_strengths:
                arms += [Arm(optimizer, "kfac", c, seed, label) for label in (self.union, self.default_kfac) if label]
        return arms

    def behaviour_arms(self) -> list[Arm]:
        """Every arm of the behavioural plan, in the module docstring's order (each once)."""
        first = [arm for o in SUPERVISED for arm in self.runs(o, 0, True) if arm.method in BEHAVIOUR_FIRST]
        several = [arm for seed in self.seeds for arm in self.several_runs(seed)]
        second = [arm for o in SUPERVISED for s in self.seeds[1:] for f in (True, False) for arm in self.runs(o, s, f)]
        rest = [arm for o in SUPERVISED for f in (True, False) for arm in self.runs(o, self.seeds[0], f)]
        rest += [Arm(o, method, c, 2, anchor) for o, method, c, anchor in self.third_seed_arms]
        summed = [
            Arm(o, "kfac_summed", c, seed, self.summed)
            for seed in self.seeds
            for o in self.several_optimizers
            for c in self.kfac_strengths
            if self.summed
        ]
        return list(dict.fromkeys([*first, *several, *second, *rest, *summed]))

    def anchors_of(self, arm: Arm) -> set[str]:
        """The anchors `arm` trains with: the math diagonal one (every lam comes from an anchor's p99), the
        protecting anchor, and for K-FAC arms the full anchor its lam comes from."""
        if arm.method in ("isotropic", "cfp", "lwf"):
            return {"math", "isotropic"} if arm.method == "isotropic" else {"math"}
        if arm.method in ("kfac", "lora_kfac") and arm.anchor:
            return {kfac_anchor_name(arm.anchor), kfac_lam_anchor(arm.anchor)}
        if arm.method == "kfac_summed" and arm.anchor:
            labels = summed_labels(arm.anchor)
            return {kfac_anchor_name(label) for label in labels} | {kfac_lam_anchor(label) for label in labels}
        return set()


TINY = Plan(
    anchors=EVIDENCE_TINY,
    steps=8,
    points=4,
    batch_size=4,
    dpo_batch_size=2,
    sft_learning_rate=3e-3,
    dpo_learning_rate=3e-3,
    dpo_beta=0.1,
    task_prompts=32,
    heldout_prompts=8,
    task_new_tokens=8,
    math_items=12,
    math_new_tokens=4,
    kl_prompts=4,
    kl_samples=2,
    kl_new_tokens=6,
    sft_kl_betas=(0.3,),
    dpo_kl_betas=(1.0,),
    lwf_betas=(1.0,),
    isotropic_strengths=(1.0,),
    cfp_strengths=(1.0, 10.0),
    kfac_strengths=(1.0,),
    dpo_cfp_strengths=(),
    wiseft_alphas=(0.5,),
    lora_rank=4,
    lora_learning_rate=3e-3,
    grpo_rewards=("pirate",),
    grpo_seeds=(0,),
    grpo_steps=4,
    grpo_learning_rate=3e-3,
    grpo_kl_betas=(0.5,),
    grpo_batch_size=4,
    grpo_generations=2,
    grpo_completion_tokens=6,
    grpo_eval_prompts=4,
    grpo_eval_samples=1,
)

EMBEDDED = Plan(
    anchors=EVIDENCE_EMBEDDED,
    steps=256,
    points=8,
    batch_size=4,
    dpo_batch_size=2,
    sft_learning_rate=1e-5,
    dpo_learning_rate=2e-6,
    dpo_beta=0.1,
    task_prompts=512,
    heldout_prompts=64,
    task_new_tokens=40,
    math_items=204,
    math_new_tokens=16,
    kl_prompts=24,
    kl_samples=4,
    kl_new_tokens=32,
    sft_kl_betas=(0.3, 3.0),
    # On DPO the KL penalty and both CFP geometries at their first strength end below half the unregularized margin
    # (21-34%): their second strengths are weaker, so that the sweep brackets the matched-progress targets.
    dpo_kl_betas=(0.5, 0.2),
    lwf_betas=(1.0, 10.0),
    isotropic_strengths=(1.0, 0.1),  # c = 1 nearly stops the task: the second strength is weaker
    cfp_strengths=(1.0, 10.0),
    kfac_strengths=(1.0, 10.0),
    dpo_cfp_strengths=(1.0, 0.1),
    wiseft_alphas=(0.25, 0.5, 0.75),
    lora_rank=16,
    lora_learning_rate=1e-4,
    grpo_learning_rate=1e-4,  # the rate at which the pirate reward rises (scripts/grpo_pilot.py; evidence report)
)

# The behavioural run (issue 50): the same set-up, data, steps and strengths as EMBEDDED, fixed before its first
# result; its output goes to its own directory (`scripts/long_run.py --behaviour`).
SEVERAL_OPTIMIZERS = ("sft", "grpo-brevity")
EMBEDDED_BEHAVIOUR = replace(
    EMBEDDED,
    anchors=replace(EVIDENCE_EMBEDDED, kfac_union=("math", "safety")),
    seeds=(0, 1),
    behaviour=True,
    union="mathsafety_t256",
    third_seed_arms=(
        ("grpo-pirate", "unregularized", 0.0, None),
        ("grpo-pirate", "kfac", 10.0, "math"),
        ("grpo-pirate", "kfac", 10.0, "math_t256"),
        ("grpo-pirate", "isotropic", 1.0, "math"),
    ),
    several_optimizers=SEVERAL_OPTIMIZERS,
    summed="math+safety_t256",
)
TINY_BEHAVIOUR = replace(
    TINY,
    anchors=replace(EVIDENCE_TINY, kfac_union=("math", "safety")),
    seeds=(0, 1),
    behaviour=True,
    grpo_rewards=("pirate", "brevity"),
    union="mathsafety_t2",  # the tiny evidence plan's default truncation, math_t2
    several_optimizers=SEVERAL_OPTIMIZERS,
    summed="math+safety_t2",
)
