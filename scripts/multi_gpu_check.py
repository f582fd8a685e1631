"""A short Trainer run under `accelerate launch` (DDP, FSDP1/2 or DeepSpeed ZeRO-2/3, as the config file says),
twice on the same data for each anchor structure: CFPCallback with lam = 0 (the unprotected path, still measured)
and with lam = LAM, protected by a diagonal anchor (a random F) and by a K-FAC anchor (rank 8 with tails, estimated
on the tiny model). The main process prints the last logged cfp metrics of each and checks that protection shrank
the sensitive drift (to under half). The numbers themselves are checked against references by the CPU
multi-process tests (tests/integration/test_distributed.py, test_deepspeed.py, test_kfac_distributed.py,
test_kfac_deepspeed.py); this checks the same code on GPUs.

    accelerate launch --config_file scripts/accelerate/fsdp2.yaml scripts/multi_gpu_check.py   # >= 2 GPUs
    python scripts/multi_gpu_check.py                                                          # one device
"""

import json
import tempfile

import torch
from transformers import Trainer, TrainingArguments

from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher
from hf_cfp.loading.models import tiny_llama

LAMS, STEPS = {"diagonal": 10.0, "kfac": 1000.0}, 8


def make_model():
    return tiny_llama(vocab_size=128, hidden_size=64, layers=2, heads=4, seed=0)


def make_anchor(structure: str) -> FisherAnchor:
    """A diagonal anchor of random F, or a K-FAC anchor (rank 8, tails) estimated on the tiny model, named `check`."""
    model = make_model()
    if structure == "diagonal":
        g = torch.Generator().manual_seed(1)
        return FisherAnchor({n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()}, name="check")
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    return estimate_fisher(
        model,
        None,
        prompts,
        num_sequences=8,
        max_new_tokens=8,
        batch_size=4,
        seed=0,
        structure="kfac",
        kfac_rank=8,
        show_progress=False,
        name="check",
    )


def run(anchor: FisherAnchor, lam: float, output_dir: str) -> tuple[dict[str, float], bool]:
    """(the cfp metrics logged at the last step, whether this is the main process)."""
    model = make_model()
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 128, (64, 32), generator=g)]
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        logging_steps=STEPS,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[CFPCallback(anchor, lam=lam)])
    trainer.train()
    logged = [h for h in trainer.state.log_history if any(k.startswith("cfp/") for k in h)][-1]
    return {k: v for k, v in logged.items() if k.startswith("cfp/")}, trainer.is_world_process_zero()


def main():
    for structure, lam in LAMS.items():
        anchor = make_anchor(structure)
        with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as protected_dir:
            plain, main_process = run(anchor, 0.0, plain_dir)
            protected, _ = run(anchor, lam, protected_dir)
        if main_process:
            print(json.dumps({"structure": structure, "lam=0": plain, f"lam={lam}": protected}, indent=1))
            shrink = protected["cfp/check/sensitive_drift"] / plain["cfp/check/sensitive_drift"]
            print(f"MULTI_GPU_CHECK {structure} sensitive_drift lam={lam} / lam=0: {shrink:.3f}")
            assert shrink < 0.5, f"CFP with a {structure} anchor did not shrink the sensitive drift"
            assert protected["cfp/total_drift"] > 0 and plain["cfp/total_drift"] > 0


if __name__ == "__main__":
    main()
