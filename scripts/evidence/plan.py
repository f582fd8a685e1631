"""What the evidence experiment runs: the arms (rows) and the sizes, for the tiny model and the embedded one.

An arm is one training run from the base weights: an optimizer (SFT on the pirate-style pairs, or DPO on
the pirate preference pairs), a method and its strength, and a seed. Methods:

- `unregularized`: the optimizer alone (DPO keeps its own beta, `Plan.dpo_beta`);
- `kl`: the output-space KL control: SFT adds beta * token KL to the base on the training tokens
  (`KLPenaltySFTTrainer`), DPO uses a larger beta; strength = beta;
- `cfp`: CFP with one anchor (math, code, safety, or a math anchor of another quality);
  strength c gives lam = c / p99(F) of that anchor;
- `step_only`: the variant that preconditions only the latest step (`StepOnlyCallback`), math anchor,
  lam = c / p99(F_math);
- `isotropic`: CFP with F_math replaced by its mean (`isotropic_anchor`), lam = c / p99(F_math): the same
  lam and total mass without the shape;
- `budget`: CFP with lam_t chosen every step to keep the predicted KL 0.5 Delta^T F Delta of the protecting
  anchor within strength = the budget in nats (`CFPCallback(kl_budget=...)`; the budget table,
  `scripts/budget_table.py`, not the evidence plan).

The table rows use `Plan.table_strength` (c = 1: lam = 1/p99, the README's rule) and the first KL
strength; the other strengths only add points to the frontier, drawn from the first seed. Every seed repeats
the table rows; greedy scores are taken on a few rows of the first seed (`Plan.measures_greedy`).
"""

from dataclasses import dataclass, field

DOMAINS = ("math", "code", "safety")
OPTIMIZERS = ("sft", "dpo")
METHODS = ("unregularized", "kl", "cfp", "step_only", "isotropic", "budget")


@dataclass(frozen=True)
class Arm:
    """One training run. `anchor` names the protecting anchor (cfp, step_only, isotropic) or is None."""

    optimizer: str
    method: str
    strength: float
    seed: int
    anchor: str | None = None

    @property
    def key(self) -> str:
        """A unique, readable id, e.g. `sft/cfp[math]@1/seed0`."""
        anchor = f"[{self.anchor}]" if self.anchor else ""
        return f"{self.optimizer}/{self.method}{anchor}@{self.strength:g}/seed{self.seed}"


@dataclass(frozen=True)
class Plan:
    """Sizes of one experiment (see `TINY` and `EMBEDDED`)."""

    seeds: tuple[int, ...]
    steps: int
    batch_size: int  # SFT sequences per step
    dpo_batch_size: int  # DPO pairs per step (each pair is two sequences)
    sft_learning_rate: float
    dpo_learning_rate: float
    dpo_beta: float
    anchor_sequences: int  # calibration sequences of the math, code and safety anchors
    anchor_new_tokens: int
    cfp_strengths: tuple[float, ...]  # c in lam = c / p99(F)
    sft_kl_betas: tuple[float, ...]
    dpo_kl_betas: tuple[float, ...]
    isotropic_strengths: tuple[float, ...]
    quality_sequences: tuple[int, ...]  # extra math anchors (sequence estimator), besides anchor_sequences
    token_sequences: int  # a math anchor from the token estimator (0: none)
    kl_prompts: int  # held-out prompts per domain for kl_to_base
    kl_samples: int  # base responses per prompt
    kl_new_tokens: int
    greedy_new_tokens: int  # math exact match; refusals use half
    table_strength: float = 1.0
    optimizers: tuple[str, ...] = field(default=OPTIMIZERS)

    def quality_anchors(self) -> dict[str, tuple[int, str]]:
        """{name: (num_sequences, estimator)} of the extra math anchors of the anchor-quality sweep."""
        anchors = {f"math_n{n}": (n, "sequence") for n in self.quality_sequences}
        if self.token_sequences:
            anchors["math_token"] = (self.token_sequences, "token")
        return anchors

    def kl_betas(self, optimizer: str) -> tuple[float, ...]:
        return self.sft_kl_betas if optimizer == "sft" else self.dpo_kl_betas

    def is_table_row(self, arm: Arm | dict) -> bool:
        """A row of the tables: the unregularized run, the first KL strength, and the other methods at
        `table_strength` with one of the three domain anchors. `arm` is an `Arm` or its dict."""
        arm = Arm(**arm) if isinstance(arm, dict) else arm
        if arm.method == "unregularized":
            return True
        if arm.method == "kl":
            return arm.strength == self.kl_betas(arm.optimizer)[0]
        return arm.strength == self.table_strength and arm.anchor in DOMAINS

    def measures_greedy(self, arm: Arm) -> bool:
        """Greedy scores (math exact match, refusal rate: the costliest measurements) on the first seed's
        unregularized, first-KL, CFP [math] and CFP [safety] rows only."""
        return (
            arm.seed == self.seeds[0]
            and self.is_table_row(arm)
            and arm.method in ("unregularized", "kl", "cfp")
            and arm.anchor in (None, "math", "safety")
        )

    def arms(self) -> list[Arm]:
        """The first seed runs every strength of every method (the frontier) and, for SFT, CFP with each
        quality anchor; the other seeds repeat the table rows (their means and spread)."""
        arms = []
        for seed in self.seeds:
            for optimizer in self.optimizers:
                every = [Arm(optimizer, "unregularized", 0.0, seed)]
                every += [Arm(optimizer, "kl", beta, seed) for beta in self.kl_betas(optimizer)]
                every += [Arm(optimizer, "cfp", c, seed, "math") for c in self.cfp_strengths]
                every += [Arm(optimizer, "cfp", self.table_strength, seed, domain) for domain in DOMAINS[1:]]
                every += [Arm(optimizer, "step_only", c, seed, "math") for c in self.cfp_strengths]
                every += [Arm(optimizer, "isotropic", c, seed, "math") for c in self.isotropic_strengths]
                arms += [arm for arm in every if seed == self.seeds[0] or self.is_table_row(arm)]
            if seed == self.seeds[0] and "sft" in self.optimizers:
                arms += [
                    Arm("sft", "cfp", c, seed, name) for name in self.quality_anchors() for c in self.cfp_strengths
                ]
        return arms


TINY = Plan(
    seeds=(0, 1, 2),
    steps=6,
    batch_size=4,
    dpo_batch_size=2,
    sft_learning_rate=3e-3,
    dpo_learning_rate=3e-3,
    dpo_beta=0.1,
    anchor_sequences=8,
    anchor_new_tokens=8,
    cfp_strengths=(1.0, 10.0),
    sft_kl_betas=(0.3,),
    dpo_kl_betas=(1.0,),
    isotropic_strengths=(1.0, 100.0),
    quality_sequences=(4, 16),
    token_sequences=8,
    kl_prompts=4,
    kl_samples=2,
    kl_new_tokens=6,
    greedy_new_tokens=4,
)

EMBEDDED = Plan(
    seeds=(0, 1),
    steps=8,
    batch_size=4,
    dpo_batch_size=2,
    sft_learning_rate=1e-4,
    dpo_learning_rate=1e-5,
    dpo_beta=0.1,
    anchor_sequences=32,
    anchor_new_tokens=32,
    cfp_strengths=(1.0, 10.0),
    sft_kl_betas=(0.3, 3.0),
    dpo_kl_betas=(0.5, 2.5),
    isotropic_strengths=(1.0, 100.0),
    quality_sequences=(16, 64, 128),
    token_sequences=4,
    kl_prompts=8,
    kl_samples=2,
    kl_new_tokens=32,
    greedy_new_tokens=64,
)
