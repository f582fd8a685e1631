"""A KL budget in nats: the lams that keep every protecting anchor's predicted KL within its budget.

For the sequence-level Fisher F_k of capability k, KL(mu_0 || mu_theta) ~ 0.5 Delta^T F_k Delta to second
order on its calibration distribution. The optimizer proposes the displacement D = theta' - theta0; CFP makes
it D / (1 + P), P = sum_k lam_k F_k, so anchor k's predicted KL after the correction is

    KL_k(lam) = 0.5 sum_i F_{k,i} D_i^2 / (1 + P_i)^2,      dKL_k / dlam_k = -sum_i F_{k,i}^2 D_i^2 / (1 + P_i)^3,

decreasing in every lam_j. The lams chosen are the multipliers of the Euclidean projection of the proposal onto
the budget set,

    minimize ||Delta - D||^2  subject to  0.5 Delta^T F_k Delta <= B_k  for every k,

whose solution is Delta = D / (1 + sum_k lam_k F_k) with lam_k >= 0 and lam_k = 0 wherever KL_k < B_k: the
correction moves the proposal no further than the budgets need, and inside every budget it keeps the proposal
exactly (all lam_k = 0). Solved by exact coordinate ascent on the concave dual, whose gradient is KL_k - B_k:
for one anchor at a time the scalar equation KL_k(lam_k) = B_k with the other lams fixed, by Newton's method on
log KL against log lam (KL ~ c / lam^2 for large lam, so nearly linear there) inside a bracket; sweeps repeat
until every budget holds. Each evaluation is one pass over the protected coordinates.
"""

import math
from collections.abc import Callable, Sequence

import torch

from ..errors import CFPError
from .chunks import gather, packs, workspace
from .correction import AnchorFishers, fused_runs, pack_strength

# lams -> float64 tensor [2, K]: row 0 the predicted KL of each anchor, row 1 dKL_k / dlam_k.
Evaluate = Callable[[Sequence[float]], torch.Tensor]


def budget_terms(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    fishers: AnchorFishers,
    lams: Sequence[float],
    chunk: int | None = None,
) -> torch.Tensor:
    """[KL_k, dKL_k / dlam_k] for every anchor k (float64 [2, K], on the CPU) for the proposal D = params - theta0:

        KL_k = 0.5 sum_i F_k,i (D_i / (1 + P_i))^2,   dKL_k / dlam_k = - sum_i F_k,i^2 D_i^2 / (1 + P_i)^3

    with P = sum_k lam_k F_k. The tensors covered by the same anchors are laid out in packs of at most `chunk`
    elements (default `chunk_elements(device)`; `packs`) in four reused float32 buffers (`workspace`), each
    pack's sums accumulated in float64 on the parameters' device (no synchronization per pack); a tensor covered by
    one anchor, with theta0 and F beside it, by one fused kernel (`fused`) where they can run. `fishers[i][k]`
    is anchor k's F on `params[i]`, or None."""
    covering = [tuple(k for k, fisher in enumerate(row) if fisher is not None) for row in fishers]
    sums: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        flats = [param.reshape(-1) for param in params]
        starts = [start.reshape(-1) for start in theta0]
        rows = [[f.reshape(-1) if f is not None else None for f in row] for row in fishers]
        for i in fused_budget(flats, starts, rows, covering, lams, sums):
            covering[i] = ()  # done
        for pack in packs(flats, covering, chunk):
            if not pack.key:
                continue
            acc = sums.setdefault(pack.device, torch.zeros(2, len(lams), dtype=torch.float64, device=pack.device))
            relief_buffer, fisher_buffer, shrunk_buffer, weighted_buffer = workspace(pack.device, 4, pack.length)
            relief = pack_strength(pack, rows, lams, relief_buffer, fisher_buffer).add_(1.0)  # 1 + P
            shrunk = gather(shrunk_buffer, pack, flats).sub_(gather(weighted_buffer, pack, starts))
            shrunk.div_(relief).square_()  # (D / (1 + P))^2
            for k in pack.key:
                fisher = gather(fisher_buffer, pack, [row[k] for row in rows])
                weighted = torch.mul(shrunk, fisher, out=weighted_buffer[: pack.size])  # F D^2 / (1 + P)^2
                acc[0, k] += 0.5 * weighted.sum(dtype=torch.float64)
                acc[1, k] -= weighted.mul_(fisher).div_(relief).sum(dtype=torch.float64)
    return sum((acc.cpu() for acc in sums.values()), torch.zeros(2, len(lams), dtype=torch.float64))


def fused_budget(flats, starts, rows, covering, lams: Sequence[float], sums: dict[torch.device, torch.Tensor]):
    """The indices of the tensors whose terms the fused kernel ("budget", `correction.fused_runs`) added into
    `sums[device]`."""
    done: list[int] = []
    for device, k, members, terms in fused_runs("budget", flats, starts, rows, covering, lams):
        acc = sums.setdefault(device, torch.zeros(2, len(lams), dtype=torch.float64, device=device))
        acc[:, k] += terms.double().sum(0)
        done += members
    return done


def solve_budget(
    evaluate: Evaluate,
    budgets: Sequence[float],
    start: Sequence[float],
    tolerance: float = 0.01,
    max_sweeps: int = 50,
) -> list[float]:
    """The lams with (1 - tolerance) B_k <= KL_k <= B_k where lam_k > 0 and KL_k <= B_k where lam_k = 0.

    `start` is a warm start (the previous step's lams). Raises CFPError when the sweeps do not settle (a budget
    the correction cannot reach: a non-finite evaluation, or F that does not decrease the KL)."""
    lams = [float(lam) for lam in start]
    terms = evaluate(lams)
    for _ in range(max_sweeps):
        settled = True
        for k, budget in enumerate(budgets):
            if not _holds(terms, k, budget, lams[k], tolerance):
                lams[k], terms = _solve_one(evaluate, lams, k, budget, terms, tolerance)
                settled = False
        if settled:
            return lams
    raise CFPError(
        f"predicted_kl_budget: no lams within {max_sweeps} sweeps keep the predicted KL {terms[0].tolist()} within "
        f"the budgets {list(budgets)} (last lams {lams}). Check the anchors for non-finite or negative F, or use lam."
    )


def _holds(terms: torch.Tensor, k: int, budget: float, lam: float, tolerance: float) -> bool:
    kl = float(terms[0, k])
    return kl <= budget and (lam == 0 or kl >= (1 - tolerance) * budget)


def _solve_one(
    evaluate: Evaluate, lams: list[float], k: int, budget: float, terms: torch.Tensor, tolerance: float
) -> tuple[float, torch.Tensor]:
    """lam_k with the budget of anchor k held (the others fixed), and the terms there."""
    aim = (1 - tolerance / 2) * budget
    low, high = 0.0, math.inf  # KL_k(low) > budget >= KL_k(high), once lam = 0 is checked
    lam = lams[k]
    zero_checked = False
    for _ in range(100):
        if _holds(terms, k, budget, lam, tolerance):
            return lam, terms
        kl, slope = float(terms[0, k]), float(terms[1, k])
        if not (math.isfinite(kl) and math.isfinite(slope)):
            break
        zero_checked = zero_checked or lam == 0
        if kl > budget:
            low = lam
        else:
            high = lam
        if not zero_checked and high < math.inf:  # over-protected: no pull at all may be within the budget
            lam = 0.0
        else:
            lam = _next_lam(lam, kl, slope, aim, low, high)
        terms = evaluate([*lams[:k], lam, *lams[k + 1 :]])
    raise CFPError(
        f"predicted_kl_budget: could not bring anchor {k}'s predicted KL ({float(terms[0, k]):.4g} nats) to its "
        f"budget ({budget:.4g} nats) by choosing its lam (last tried {lam:.4g}). Its F may be non-finite or zero "
        "where the model moves; check the anchor, or use lam."
    )


def _next_lam(lam: float, kl: float, slope: float, aim: float, low: float, high: float) -> float:
    """Newton's step on log KL against log lam toward `aim` (from lam = 0: the root of KL0 / (1 + lam F)^2 = aim,
    F the KL-weighted mean), replaced by bisection (geometric once both ends are positive) outside (low, high)."""
    guess = math.nan
    if lam > 0 and kl > 0 and slope < 0:
        guess = lam * math.exp(max(-50.0, min(50.0, math.log(aim / kl) * kl / (lam * slope))))
    elif lam == 0 and slope < 0:
        guess = (math.sqrt(kl / aim) - 1) * 2 * kl / -slope
    if low < guess < high:
        return guess
    if high == math.inf:
        return max(2 * low, 1e-12)
    return math.sqrt(low * high) if low > 0 else high / 2
