"""Reading TensorBoard event files back, to check what the reporters received."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(logdir):
    """tag -> [(step, value)] from every TensorBoard event file under `logdir`."""
    files = sorted(Path(logdir).rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {logdir}"
    scalars = {}
    for run in sorted({f.parent for f in files}):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars
