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
  anchor within strength = the budget in nats (`CFPCallback(predicted_kl_budget=...)`; the budget table,
  `scripts/budget_table.py`, not the evidence plan).

The table rows use `Plan.table_strength` (c = 1: lam = 1/p99, the README's rule) and the first KL
strength; the other strengths only add points to the frontier, drawn from the first seed. Every seed repeats
the table rows; greedy scores are taken on a few rows of the first seed (`Plan.measures_greedy`).

Added with the Kronecker-factored anchors (issue 25; `is_new`: their arms are also monitored by the math K-FAC
anchor, whose predicted KL 0.5 tr(Delta^T G Delta A) is recorded as `math/kfac_predicted_kl`, and log only at
the last step):

- `kfac`: CFP with a K-FAC anchor (`estimate_fisher(structure="kfac")` on the same calibration prompts, sampler,
  sizes and seed as the diagonal ones), lam = c / p99 of that anchor (p99 over the eigenvalue products
  gamma_i alpha_j and the diagonal F of its other parameters). `Arm.anchor` is a label (`kfac_anchor_name`):
  a domain (`math`, `code`, `safety`: table rows, every seed), `math_r<r>` (the math anchor truncated to its
  top r eigenpairs per factor, lam of the full anchor: the rank sweep) or `math_n<n>` (a math K-FAC anchor of
  n sequences: the anchor-size sweep); the strength sweep of `math` and both sweeps run on the first seed;
- an on-policy RL optimizer, TRL's RLOO, `rloo-<reward>` (`rl_optimizer`), on the pirate-style prompts with one
  of `RL_REWARDS` (`rewards.py`): unregularized (beta 0), `kl` (RLOO's own KL penalty, strength = beta),
  `isotropic`, `cfp` and `kfac` with the math anchors at `table_strength`; first seed.

Added with the K-FAC tails (issue 30), after every arm above (`truncation_arms`, `default_arms`), the rank and tail
sweep of CFP-KFAC [math]. A truncated label is `<domain>_<letter><number>` (`truncation`), the anchor
`<domain>_kfac_<letter><number>` derived from the full `<domain>_kfac` when loaded (`controls`), lam = c / p99 of
the FULL anchor (`kfac_lam_anchor`):

- `math_r<r>`: the top r eigenpairs of each factor, the rest free (zero tail): the issue-25 truncation, unchanged;
- `math_t<r>`: the top r eigenpairs of each factor and the rest at their mean (mean tail, trace-preserving);
- `math_s<pct>`: per factor, the fewest eigenpairs whose eigenvalues hold >= pct% of the factor's trace, the rest
  at their mean (mean tail): a rule that transfers to wider layers, where an absolute rank may not.

First seed, SFT and DPO, for the ranks `kfac_tail_ranks` (both tails) and the shares `kfac_shares`, at
`table_strength` and, for the mean tails and the shares, the weaker `truncation_strengths` (most mean-tail ranks made
a little less task progress than full rank at c = 1, so that only a weaker c can bracket full rank's progress), in
this order: the mean-tail ranks at `table_strength`, then at `truncation_strengths`; the shares at `table_strength`
and `truncation_strengths`; the zero-tail ranks at `table_strength` (those of `kfac_ranks` ran already). Within a
block: strength, then truncation (ranks ascending), then optimizer, so that each finished point has both. The
stronger `kfac_strengths` run for full rank and the default only: they cannot change which truncation is within
`RULE_RATIO` of full rank at full rank's task progress, and the CPU time went to the long run (`scripts/longrun`).

`kfac_default` (None by default: the sweep decides it) names the chosen truncation, e.g. `math_t64`: CFP-KFAC with
that truncation of the math, code and safety K-FAC anchors (`math_t64`, `code_t64`, `safety_t64`) at
`table_strength` on every seed, SFT and DPO, after the blocks that decide it; they are table rows (`is_table_row`),
without greedy scores. Then the default's strength sweep (the math truncation at the other `kfac_strengths`,
first seed).
"""

import re
from dataclasses import dataclass, field

DOMAINS = ("math", "code", "safety")
OPTIMIZERS = ("sft", "dpo")
METHODS = ("unregularized", "kl", "cfp", "kfac", "step_only", "isotropic", "budget")
RL_REWARDS = ("pirate", "brevity")
RL_PREFIX = "rloo-"  # an RL optimizer's name: RLOO and its reward, `rloo-pirate`
KFAC_MONITOR = "math_kfac"  # the K-FAC anchor every new arm is measured on (`is_new`)


def rl_optimizer(reward: str) -> str:
    """The optimizer name of RLOO with `reward`: `rloo-pirate`."""
    return RL_PREFIX + reward


def rl_reward(optimizer: str) -> str | None:
    """The reward of an RL optimizer name (`rloo-pirate` -> `pirate`), None for SFT and DPO."""
    return optimizer[len(RL_PREFIX) :] if optimizer.startswith(RL_PREFIX) else None


# the letter of a truncated K-FAC label -> the tail of what it leaves out (module docstring)
TRUNCATION_TAILS = {"r": "zero", "t": "mean", "s": "mean"}


def truncation(label: str) -> tuple[str, str, int] | None:
    """(domain, letter, number) of a truncated K-FAC label: `math_t64` -> ("math", "t", 64), `code_s90` ->
    ("code", "s", 90); None for any other label (`math`, `math_n16`)."""
    domain, _, variant = label.partition("_")
    found = re.fullmatch(r"([rts])([0-9]+)", variant)
    return (domain, found[1], int(found[2])) if found else None


def kfac_anchor_name(label: str) -> str:
    """The K-FAC anchor a `kfac` arm's label stands for: `math` -> `math_kfac`, `math_r8` -> `math_kfac_r8`,
    `math_t64` -> `math_kfac_t64`, `math_n16` -> `math_kfac_n16` (the names under `<output_dir>/anchors/` and in
    the metric keys)."""
    domain, _, variant = label.partition("_")
    return f"{domain}_kfac" + (f"_{variant}" if variant else "")


def kfac_lam_anchor(label: str) -> str:
    """The anchor whose p99 sets lam = c / p99 for a `kfac` arm: its own, except for a truncation (`math_r<r>`,
    `math_t<r>`, `math_s<pct>`, `code_t<r>`...), which takes its full anchor's (the same lam on a cut geometry)."""
    cut = truncation(label)
    return kfac_anchor_name(cut[0] if cut else label)


def truncation_spec(label: str) -> "AnchorSpec":
    """How the anchor of a truncated label is made from its full K-FAC anchor: `math_r8` -> rank 8, zero tail;
    `math_t8` -> rank 8, mean tail; `math_s90` -> the 90% trace share, mean tail."""
    cut = truncation(label)
    if cut is None:
        raise ValueError(f"{label!r} is not a truncated K-FAC label (<domain>_r<r>, _t<r> or _s<pct>)")
    domain, letter, number = cut
    source, tail = kfac_anchor_name(domain), TRUNCATION_TAILS[letter]
    if letter == "s":
        return AnchorSpec("truncated", domain, source=source, share=number / 100, tail=tail)
    return AnchorSpec("truncated", domain, source=source, rank=number, tail=tail)


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


def is_new(arm: Arm) -> bool:
    """An arm added with the K-FAC anchors (issue 25): method `kfac`, or an RL optimizer. These are measured on
    `KFAC_MONITOR` too and log (compute their drift metrics) only at the last step."""
    return arm.method == "kfac" or rl_reward(arm.optimizer) is not None


@dataclass(frozen=True)
class AnchorSpec:
    """How one anchor of the plan is made (`Plan.anchor_specs`, built by `anchors.AnchorStore`):

    - `estimated`: `estimate_fisher` on `sequences` calibration sequences of `domain`, `estimator`, `seed`,
      `structure` ("diagonal" or "kfac"), saved under `<output_dir>/anchors/<name>`;
    - `pooled`: the anchor of all the `parts`' sequences (`FisherAnchor.combine` of equally many sequences each);
    - `truncated`: `source` (K-FAC) with the top `rank` eigenpairs of each factor, or per factor the fewest
      holding `share` (a fraction) of its trace, and `tail` ("zero" or "mean") for the rest
      (`controls.truncated_anchor`, `controls.share_truncated_anchor`);
    - `isotropic`: `source` with F replaced by its mean (`controls.isotropic_anchor`).
    """

    kind: str
    domain: str = "math"
    sequences: int = 0
    estimator: str = "sequence"
    seed: int = 0
    structure: str = "diagonal"
    parts: tuple[str, ...] = ()
    source: str | None = None
    rank: int | None = None
    share: float | None = None
    tail: str = "zero"


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
    # K-FAC arms (none by default): c of CFP-KFAC [math] besides table_strength; truncation ranks; other sizes of
    # the math K-FAC anchor (a multiple K of anchor_sequences pools K parts of seeds 0..K-1, a power of 2)
    kfac_strengths: tuple[float, ...] = ()
    kfac_ranks: tuple[int, ...] = ()
    kfac_sizes: tuple[int, ...] = ()
    # the rank and tail sweep (issue 30; none by default), at every kfac_strengths: ranks with both tails
    # (`math_t<r>`, `math_r<r>`), trace shares in percent (`math_s<pct>`); the chosen truncation's table rows
    kfac_tail_ranks: tuple[int, ...] = ()
    kfac_shares: tuple[int, ...] = ()
    truncation_strengths: tuple[float, ...] = ()  # c of the mean-tail truncations only, below table_strength
    kfac_default: str | None = None
    # domains whose K-FAC anchors are pooled into one (`<d1><d2>_kfac`, e.g. `mathsafety_kfac`: the anchor of their
    # calibration sequences together), with the default's truncation of it (`mathsafety_kfac_t256`)
    kfac_union: tuple[str, ...] = ()
    # RL arms (none by default): RLOO on the pirate-style prompts, one optimizer per reward
    rl_rewards: tuple[str, ...] = ()
    rl_kl_betas: tuple[float, ...] = ()
    rl_learning_rate: float = 1e-5
    rl_batch_size: int = 8  # completions per step: rl_batch_size / rl_generations prompts
    rl_generations: int = 4  # completions per prompt (the leave-one-out group)
    rl_completion_tokens: int = 24
    rl_eval_samples: int = 2  # completions per training prompt for the reward of a trained model (seed 0)

    def __post_init__(self) -> None:
        if self.kfac_default is not None and truncation(self.kfac_default) is None:
            raise ValueError(f"kfac_default={self.kfac_default!r}: a truncated label such as 'math_t64' or 'math_s90'")
        if any(not 0 < p <= 100 for p in self.kfac_shares):
            raise ValueError(f"kfac_shares={self.kfac_shares!r}: percentages in (0, 100]")

    def quality_anchors(self) -> dict[str, tuple[int, str]]:
        """{name: (num_sequences, estimator)} of the extra math anchors of the anchor-quality sweep."""
        anchors = {f"math_n{n}": (n, "sequence") for n in self.quality_sequences}
        if self.token_sequences:
            anchors["math_token"] = (self.token_sequences, "token")
        return anchors

    def anchor_specs(self) -> dict[str, AnchorSpec]:
        """Every anchor an arm of the plan can need, by name: the math, code and safety anchors, diagonal
        (`<domain>`) and K-FAC (`<domain>_kfac`), `anchor_sequences` each, seed 0; the quality sweep's diagonal
        math anchors (`quality_anchors`); the K-FAC size sweep's (`math_kfac_n<n>`) math anchors and the parts
        pooled into them; the truncated K-FAC anchors (`truncation_labels`: `math_kfac_r<r>`, `math_kfac_t<r>`,
        `math_kfac_s<pct>`, the default's three, and its truncation of the union); the union of `kfac_union`
        (`<d1><d2>_kfac`, pooled from their K-FAC anchors); and `isotropic` (of the diagonal math)."""
        n = self.anchor_sequences
        specs = {d: AnchorSpec("estimated", d, n) for d in DOMAINS}
        specs |= {f"{d}_kfac": AnchorSpec("estimated", d, n, structure="kfac") for d in DOMAINS}
        for name, (size, estimator) in self.quality_anchors().items():
            specs |= self._sized("math", name, size, estimator)
        for size in self.kfac_sizes:
            specs |= self._sized(KFAC_MONITOR, f"{KFAC_MONITOR}_n{size}", size, "sequence", "kfac")
        if self.kfac_union:
            parts = tuple(f"{d}_kfac" for d in self.kfac_union)
            specs[f"{''.join(self.kfac_union)}_kfac"] = AnchorSpec("pooled", structure="kfac", parts=parts)
        specs |= {kfac_anchor_name(label): truncation_spec(label) for label in self.truncation_labels()}
        specs["isotropic"] = AnchorSpec("isotropic", source="math")
        return specs

    def truncation_labels(self) -> list[str]:
        """The truncated labels the plan's arms use: `math_r<r>` of `kfac_ranks`, `math_t<r>` and `math_r<r>` of
        `kfac_tail_ranks`, `math_s<pct>` of `kfac_shares`, and the default's `<domain>_<variant>`."""
        labels = [f"math_r{r}" for r in self.kfac_ranks]
        labels += [f"math_{letter}{r}" for r in self.kfac_tail_ranks for letter in "tr"]
        labels += [f"math_s{pct}" for pct in self.kfac_shares]
        if self.kfac_default:
            variant = self.kfac_default.partition("_")[2]
            unions = ["".join(self.kfac_union)] if self.kfac_union else []
            labels += [f"{domain}_{variant}" for domain in (*DOMAINS, *unions)]
        return list(dict.fromkeys(labels))

    def _sized(self, first: str, name: str, size: int, estimator: str, structure: str = "diagonal") -> dict:
        """{name: spec} of a math anchor of `size` sequences, with its parts: a multiple K of `anchor_sequences`
        pools K parts of seeds 0..K-1 (part 0 is the anchor `first`, part k is `<first>_part<k>`); any other size,
        or another estimator, is estimated on its own (seed 0)."""
        n = self.anchor_sequences
        if estimator != "sequence" or size % n:
            return {name: AnchorSpec("estimated", "math", size, estimator, structure=structure)}
        parts = {
            f"{first}_part{k}": AnchorSpec("estimated", "math", n, seed=k, structure=structure)
            for k in range(1, size // n)
        }
        return {**parts, name: AnchorSpec("pooled", structure=structure, parts=(first, *parts))}

    def anchors_of(self, arm: Arm) -> set[str]:
        """The anchors `arm` trains and is measured with: the diagonal math, code and safety anchors (every arm's
        DtFD), `KFAC_MONITOR` for new arms (`is_new`), and the protecting anchor (and, for `kfac`, the one its lam
        comes from, `kfac_lam_anchor`)."""
        names = set(DOMAINS) | ({KFAC_MONITOR} if is_new(arm) else set())
        if arm.method == "isotropic":
            names.add("isotropic")
        elif arm.method == "kfac" and arm.anchor:
            names |= {kfac_anchor_name(arm.anchor), kfac_lam_anchor(arm.anchor)}
        elif arm.anchor:
            names.add(arm.anchor)
        return names

    def kl_betas(self, optimizer: str) -> tuple[float, ...]:
        if rl_reward(optimizer) is not None:
            return self.rl_kl_betas
        return self.sft_kl_betas if optimizer == "sft" else self.dpo_kl_betas

    def rl_optimizers(self) -> tuple[str, ...]:
        """`rloo-<reward>` for every reward of the plan."""
        return tuple(rl_optimizer(reward) for reward in self.rl_rewards)

    def logging_steps(self, arm: Arm) -> int:
        """How often an arm logs (and computes its drift metrics): new arms (`is_new`) at the last step only,
        the others every steps // 3 steps, as they ran."""
        return self.steps if is_new(arm) else max(1, self.steps // 3)

    def is_table_row(self, arm: Arm | dict) -> bool:
        """A row of the tables: the unregularized run, the first KL strength, and the other methods at
        `table_strength` with one of the three domain anchors (for CFP-KFAC also the `kfac_default` truncation of
        one). `arm` is an `Arm` or its dict."""
        arm = Arm(**arm) if isinstance(arm, dict) else arm
        if arm.method == "unregularized":
            return True
        if arm.method == "kl":
            return arm.strength == self.kl_betas(arm.optimizer)[0]
        return arm.strength == self.table_strength and (arm.anchor in DOMAINS or self.is_default(arm))

    def is_default(self, arm: Arm) -> bool:
        """A CFP-KFAC arm protected by the `kfac_default` truncation of a domain anchor (any strength, any seed)."""
        if arm.method != "kfac" or not self.kfac_default or not arm.anchor:
            return False
        domain, _, variant = arm.anchor.partition("_")
        return domain in DOMAINS and variant == self.kfac_default.partition("_")[2]

    def measures_greedy(self, arm: Arm) -> bool:
        """Greedy scores (math exact match, refusal rate: the costliest measurements) on the first seed's
        unregularized, first-KL, CFP [math], CFP [safety], CFP-KFAC [math] and CFP-KFAC [safety] SFT and DPO rows
        only (not RL)."""
        return (
            arm.seed == self.seeds[0]
            and self.is_table_row(arm)
            and arm.optimizer in OPTIMIZERS
            and arm.method in ("unregularized", "kl", "cfp", "kfac")
            and arm.anchor in (None, "math", "safety")
        )

    def arms(self) -> list[Arm]:
        """`diagonal_arms`, then the K-FAC arms of the first seed, the RL arms, and the K-FAC table rows of the
        other seeds (`kfac_arms`, `rl_arms`): an interrupted run has the frontier before the spread. Then the rank
        and tail sweep (`truncation_arms`) and the default truncation's table rows and strength sweep
        (`default_arms`); an arm planned twice (the sweep's `math_r<r>` of
        `kfac_ranks`, the default's first-seed math rows) runs where it comes first."""
        first, *others = self.seeds
        arms = self.diagonal_arms() + self.kfac_arms((first,)) + self.rl_arms() + self.kfac_arms(tuple(others))
        arms += self.truncation_arms() + self.default_arms()
        first_of: dict[str, Arm] = {}
        for arm in arms:
            first_of.setdefault(arm.key, arm)
        return list(first_of.values())

    def sweep_strengths(self) -> tuple[float, ...]:
        """Every strength of the K-FAC sweeps, ascending: `table_strength`, `kfac_strengths` and
        `truncation_strengths` (none without `kfac_strengths`)."""
        if not self.kfac_strengths:
            return ()
        return tuple(sorted({self.table_strength, *self.kfac_strengths, *self.truncation_strengths}))

    def truncation_arms(self) -> list[Arm]:
        """The rank and tail sweep of CFP-KFAC [math] on the first seed, in the blocks of the module docstring
        (per block: strength, truncation, optimizer): every truncation at `table_strength`, the mean tails and the
        shares at `truncation_strengths`."""
        if not self.kfac_strengths:
            return []
        table, weak = (self.table_strength,), self.truncation_strengths
        mean = [f"math_t{r}" for r in self.kfac_tail_ranks]
        zero = [f"math_r{r}" for r in self.kfac_tail_ranks]
        shares = [f"math_s{pct}" for pct in self.kfac_shares]
        seed = self.seeds[0]

        blocks = [(table, mean), (weak, mean), (table + weak, shares), (table, zero)]
        return [
            Arm(optimizer, "kfac", c, seed, label)
            for strengths, labels in blocks
            for c in strengths
            for label in labels
            for optimizer in self.optimizers
        ]

    def default_arms(self) -> list[Arm]:
        """With `kfac_default` (e.g. `math_t64`): CFP-KFAC with that truncation of the math, code and safety K-FAC
        anchors at `table_strength`, per seed and optimizer (SFT, DPO); then its strength sweep, the math
        truncation at the other `kfac_strengths` on the first seed."""
        if not self.kfac_default or not self.kfac_strengths:
            return []
        variant = self.kfac_default.partition("_")[2]
        rows = [
            Arm(optimizer, "kfac", self.table_strength, seed, f"{domain}_{variant}")
            for seed in self.seeds
            for optimizer in self.optimizers
            for domain in DOMAINS
        ]
        others = [c for c in self.kfac_strengths if c != self.table_strength]
        return rows + [Arm(o, "kfac", c, self.seeds[0], self.kfac_default) for c in others for o in self.optimizers]

    def kfac_arms(self, seeds: tuple[int, ...]) -> list[Arm]:
        """Per seed and optimizer (SFT, DPO): CFP-KFAC with the math, code and safety K-FAC anchors at
        `table_strength`; on the first seed also the other `kfac_strengths` of math, the rank sweep
        (`math_r<r>`) and the anchor-size sweep (`math_n<n>`), at `table_strength`."""
        if not self.kfac_strengths:
            return []
        arms = []
        for seed in seeds:
            for optimizer in self.optimizers:
                arms += [Arm(optimizer, "kfac", self.table_strength, seed, domain) for domain in DOMAINS]
                if seed != self.seeds[0]:
                    continue
                c = self.table_strength
                arms += [Arm(optimizer, "kfac", s, seed, "math") for s in self.kfac_strengths if s != c]
                arms += [Arm(optimizer, "kfac", c, seed, f"math_r{r}") for r in self.kfac_ranks]
                arms += [Arm(optimizer, "kfac", c, seed, f"math_n{n}") for n in self.kfac_sizes]
        return arms

    def rl_arms(self) -> list[Arm]:
        """Per reward, on the first seed: unregularized, RLOO's KL penalty at each `rl_kl_betas`, and the
        isotropic pull, CFP and CFP-KFAC with the math anchors at `table_strength`."""
        seed, c = self.seeds[0], self.table_strength
        arms = []
        for optimizer in self.rl_optimizers():
            arms += [Arm(optimizer, "unregularized", 0.0, seed)]
            arms += [Arm(optimizer, "kl", beta, seed) for beta in self.rl_kl_betas]
            arms += [Arm(optimizer, method, c, seed, "math") for method in ("isotropic", "cfp", "kfac")]
        return arms

    def diagonal_arms(self) -> list[Arm]:
        """The arms that ran before the K-FAC anchors (their keys are in the committed results): the first seed
        runs every strength of every method (the frontier) and, for SFT, CFP with each quality anchor; the other
        seeds repeat the table rows (their means and spread)."""
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
    kfac_strengths=(1.0, 10.0),
    kfac_ranks=(2, 8),
    kfac_sizes=(4, 16, 32),
    kfac_tail_ranks=(2,),
    kfac_shares=(80,),
    truncation_strengths=(0.3,),
    kfac_default="math_t2",
    rl_rewards=RL_REWARDS,
    rl_kl_betas=(0.5,),
    rl_learning_rate=3e-3,
    rl_batch_size=4,
    rl_generations=2,
    rl_completion_tokens=6,
    rl_eval_samples=1,
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
    kfac_strengths=(1.0, 10.0, 100.0),
    kfac_ranks=(8, 64),
    kfac_sizes=(16, 64, 128),
    kfac_tail_ranks=(8, 16, 32, 64, 128, 256),
    kfac_shares=(50, 80, 90, 95),
    truncation_strengths=(0.3,),
    kfac_default="math_t256",  # the sweep's smallest rank within 1.25x of full rank (docs/reports/evidence.md)
    rl_rewards=RL_REWARDS,
    rl_kl_betas=(0.05,),
    rl_learning_rate=3e-4,
    rl_batch_size=8,
    rl_generations=4,
    rl_completion_tokens=24,
    rl_eval_samples=2,
)
