"""Plain reference implementations the library is compared against (none calls hf_cfp's own math)."""

import torch
from transformers import TrainerCallback


class ReferenceCFP(TrainerCallback):
    """The formula, one parameter and one expression at a time: theta0 + (theta - theta0) / (1 + lam F)."""

    def __init__(self, fisher, lam):
        self.fisher, self.lam = fisher, lam

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        lam = self.lam(state.global_step) if callable(self.lam) else self.lam
        with torch.no_grad():
            for n, p in model.named_parameters():
                t0 = self.theta0[n]
                p.copy_(t0 + (p - t0) / (1 + lam * self.fisher[n]))
