"""CFP in a plain accelerate loop (no Trainer): `python scripts/examples/accelerate_loop.py` (or accelerate launch)."""

import torch
from accelerate import Accelerator

from hf_cfp import CFP, FisherAnchor
from hf_cfp.loading.models import tiny_llama

accelerator = Accelerator(cpu=True)
model = tiny_llama()  # a tiny random Llama; use your own model
fisher = {n: torch.rand(p.shape) for n, p in model.named_parameters()}  # or FisherAnchor.from_pretrained(...)
anchor = FisherAnchor(fisher, name="math")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
protector = CFP(model, anchor, lam=10.0, optimizer=optimizer)  # theta0 = the weights now
batch = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))

for step in range(1, 6):
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    protector.step()  # theta <- theta0 + (theta - theta0) / (1 + lam F)
    metrics = protector.metrics()
    accelerator.print(f"step {step} loss {loss.item():.3f} sensitive drift {metrics['cfp/math/sensitive_drift']:.4f}")
