"""One process of `tests/integration/test_accelerate_launch.py`, started by the real `accelerate launch` with the
project's DDP config (scripts/accelerate/ddp.yaml) on the CPU: 2 gloo processes.

It trains the tiny Llama of tests/support/distributed.py with `transformers.Trainer` and CFPCallback
(`make_callback`: `math` protects, `code` monitors), each process taking ROWS / 2 of the global batch of ROWS
rows, and saves to `<out>/rank<r>.pt` the trained parameters, the last step's log, and how accelerate set up
the run (distributed type, process count, mixed precision), so that the test can tell real DDP from two
processes that each ran alone. Then it checks the trained model twice against the initial model's fingerprint
with `strict=False` (a mismatch: the weights moved) and records the warnings this process logged: a warning
that is the same everywhere must appear once, on the main process only.
"""

import logging
import sys

import torch
from accelerate.state import AcceleratorState, PartialState
from support.distributed import ROWS, make_callback, make_model, trainable, trainer_run

from hf_cfp.anchor.fingerprint import check_fingerprint, model_fingerprint


class Records(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main(out):
    launched = PartialState()  # what `accelerate launch` set up, before the Trainer uses it
    model = make_model()
    logs = trainer_run(model, [make_callback(model)], f"{out}/run", per_device_batch=ROWS // launched.num_processes)
    state = AcceleratorState()
    results = {
        "logs": logs,
        "params": trainable(model),
        "distributed_type": str(state.distributed_type),
        "num_processes": state.num_processes,
        "mixed_precision": str(state.mixed_precision),
        "fingerprint_warnings": fingerprint_warnings(model),
    }
    torch.save(results, f"{out}/rank{state.process_index}.pt")


def fingerprint_warnings(model):
    """The warnings logged here by two lenient fingerprint checks of the trained `model` against the initial one."""
    records = Records()
    logger = logging.getLogger("hf_cfp")
    logger.addHandler(records)
    try:
        for _ in range(2):
            check_fingerprint(model_fingerprint(make_model()), model, "math", strict=False)
    finally:
        logger.removeHandler(records)
    return records.messages


if __name__ == "__main__":
    main(sys.argv[1])
