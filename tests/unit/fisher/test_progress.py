"""The estimate's progress bar moves at every generation step, not once per batch, and ends at its total."""

import io

import pytest
from support.tiny import tiny_llama

from hf_cfp import estimate_fisher
from hf_cfp.fisher import estimate
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_with_supports

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]


def test_on_step_counts_the_responses_that_grew_at_each_step():
    model = tiny_llama(vocab_size=12, eos_token_id=0)  # about 1 in 12 tokens ends a response: lengths differ
    steps: list[int] = []
    responses, _ = sample_with_supports(
        model, PROMPTS * 4, Sampler(), 12, {0}, 0, batch_generator(0, 0), on_step=steps.append
    )
    lengths = [len(r) for r in responses]
    assert len(set(lengths)) > 1  # some ended at EOS, so the counts shrink
    # step t gave a token to every response longer than t; generation stops when all have ended
    assert steps == [sum(length > t for length in lengths) for t in range(max(lengths))]


class RecordingBar(estimate.tqdm):  # type: ignore[misc,valid-type]
    """tqdm that records its settings and every update (and prints nothing)."""

    made: list["RecordingBar"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
        self.unit_name, self.updates = kwargs["unit"], []
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)
        return super().update(n)


@pytest.fixture
def bars(monkeypatch):
    RecordingBar.made = []
    monkeypatch.setattr(estimate, "tqdm", RecordingBar)
    return RecordingBar.made


def test_the_estimate_bar_moves_per_token_step(bars):
    model = tiny_llama(vocab_size=12)  # no EOS: every response has max_new_tokens tokens
    estimate_fisher(model, None, PROMPTS, num_sequences=6, max_new_tokens=5, batch_size=4, engine="loop")
    (bar,) = bars
    assert bar.unit_name == "tok" and bar.total == 6 * 5 and bar.n == 30
    # two batches (4 and 2 sequences), each 5 steps, then nothing left over: no EOS
    assert bar.updates == [4] * 5 + [0] + [2] * 5 + [0]


def test_the_empirical_bar_counts_sequences(bars):
    model = tiny_llama(vocab_size=12)
    estimate_fisher(model, None, PROMPTS, num_sequences=6, batch_size=4, estimator="empirical", responses=[[1, 2]] * 4)
    (bar,) = bars
    assert bar.unit_name == "seq" and bar.updates == [4, 2] and bar.n == bar.total == 6
