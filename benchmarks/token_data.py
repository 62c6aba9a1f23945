"""Tokens, not padding (issue 38, T39-T41): real tokens a second of four ways to batch the same text.

Claim: on token rows whose lengths follow a long tail, packing several rows into one (T41:
positions restarting per sequence, attention kept within each) trains at least **1.5x** the
real tokens a second of padding every batch to the model's maximum length.

Method, in one run:

1. A GPT-2-style causal LM (transformers' ``GPT2LMHeadModel`` built from a config: ``--layers``
   layers, ``--width`` wide, 1,024 positions, a 4,096-token vocabulary, no dropout) and a
   synthetic corpus of ``--rows`` rows of random ids whose lengths are log-normal (median
   ``--median`` tokens, sigma 1.0) clipped to 16..1024, seeded.
2. Four ways to batch one epoch of it (the same rows, each once): **padded-to-max** (random
   batches of ``--batch`` rows, each padded to 1,024: the baseline), **dynamic** (T39: random
   batches padded to their longest row, rounded to 8), **grouped** (T40: length-grouped batches,
   padded as dynamic), **packed** (T41: batches of rows that fill ``--packed-rows`` rows of 1,024
   tokens, first fit decreasing; the model passed ``use_cache=False`` so that transformers reads
   the restarting positions as packed sequences). The batches are built before timing.
3. A training step is forward, the model's own loss (the mean over the tokens predicted, the
   same number for all four: tested in tests/test_token_batches.py), backward and an AdamW step.
   Each way's epoch is timed step by step after one warm-up step; ``--rounds`` rounds, the ways
   in a new random order each round, the baseline twice per round (A/A: the median of the
   per-round ratios). Real tokens a second = the epoch's tokens of data (padding not counted) /
   the epoch's step time, the median over rounds. Freed memory stays in the process
   (``keep_heap``, as ``Tricks`` does on a CPU): glibc would otherwise map the padded batches'
   large activations afresh every step, and the baseline's epochs varied by 30% between rounds.
4. Trust (``benchmarks/_trust.py``): the baseline's A/A within 10%, its step on all threads no
   slower than on one, and other processes at most a quarter of a core during the rounds; a
   failed check makes the verdict UNRELIABLE, never PASS.

    python benchmarks/token_data.py                  # ~3 minutes on 2 cores
    python benchmarks/token_data.py --rows 48 --rounds 2 --json token_data.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/_trust.py
from _trust import LoadMonitor, aa_check, rules_text, thread_check, verdict, why  # noqa: E402

TARGET = 1.5  # packed / padded-to-max real tokens a second
MAX_LEN = 1024
VOCAB = 4096
WAYS = ("padded-to-max", "dynamic", "grouped", "packed")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from torch_tricks.train.speed import keep_heap

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_heap()  # as Tricks does on a CPU: freed memory stays in the process, no fresh pages every step
    lengths = corpus_lengths(args.rows, args.median, args.seed)
    rows = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(args.seed + i))}
            for i, n in enumerate(lengths)]
    model = build_model(args.layers, args.width, args.seed)
    epochs = {way: batches(way, rows, lengths, args) for way in WAYS}
    print(f"GPT-2-style LM, {args.layers} layers x {args.width}, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters, {torch.get_num_threads()} threads; corpus {len(rows)} rows, {sum(lengths):,} tokens, "
          f"lengths {min(lengths)}-{max(lengths)} (median {int(statistics.median(lengths))})", flush=True)
    single, multi = thread_times(model, epochs["padded-to-max"][0])
    times, monitor = rounds(model, epochs, args.rounds, args.seed)
    result = report(lengths, epochs, times, single, multi, monitor)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="rows of the synthetic corpus (default 64)")
    p.add_argument("--median", type=int, default=150, help="median row length in tokens (default 150)")
    p.add_argument("--batch", type=int, default=8, help="rows a batch of the padded ways (default 8)")
    p.add_argument("--packed-rows", type=int, default=2, help="rows of 1,024 tokens a packed batch (default 2)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this file")
    return p


def corpus_lengths(n: int, median: int, seed: int) -> list[int]:
    """Log-normal lengths (sigma 1.0) with the given median, clipped to 16..1024: a long tail."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=gen) + float(torch.log(torch.tensor(float(median)))))
    return raw.clamp(16, MAX_LEN).long().tolist()


def build_model(layers: int, width: int, seed: int) -> Any:
    import torch
    import transformers

    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=MAX_LEN, vocab_size=VOCAB,
                                  bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  loss_type="ForCausalLM")
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).train()


def batches(way: str, rows: list[dict], lengths: list[int], args: argparse.Namespace) -> list[dict]:
    """One epoch of ``rows`` batched the way ``way`` does, collated up front."""
    from torch_tricks.data.token_batches import (LengthGroupedBatchSampler, PackedBatchSampler, pack_collate,
                                                 pad_collate)

    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    plain = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
    if way == "padded-to-max":
        groups, collate = plain, pad_collate(pad_to=MAX_LEN)
    elif way == "dynamic":
        groups, collate = plain, pad_collate()
    elif way == "grouped":
        groups, collate = list(LengthGroupedBatchSampler(lengths, args.batch, seed=args.seed)), pad_collate()
    else:
        groups = list(PackedBatchSampler(lengths, MAX_LEN, args.packed_rows, seed=args.seed))
        collate = pack_collate(MAX_LEN, keywords={"use_cache": False})
    out = []
    for g in groups:
        batch = collate([rows[i] for i in g])
        batch["_real"] = sum(lengths[i] for i in g)
        out.append(batch)
    return out


def step(model: Any, opt: Any, batch: dict) -> float:
    t = time.perf_counter()
    loss = model(**{k: v for k, v in batch.items() if k != "_real"}).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def thread_times(model: Any, batch: dict) -> tuple[float, float]:
    """The baseline's step on one thread and on all (after a warm-up each)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    threads = torch.get_num_threads()
    out = []
    for n in (1, threads):
        torch.set_num_threads(n)
        step(model, opt, batch)
        out.append(step(model, opt, batch))
    torch.set_num_threads(threads)
    return out[0], out[1]


def rounds(model: Any, epochs: dict[str, list[dict]], n: int, seed: int) -> tuple[dict[str, list[float]], Any]:
    """Each way's epoch time per round (padded-to-max twice: A/A), ways in a new random order each round."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    arms = list(WAYS) + ["padded-to-max (A/A)"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    rng = random.Random(seed)
    for batches_ in epochs.values():
        step(model, opt, batches_[0])  # warm-up: first shapes, allocator
    with LoadMonitor() as monitor:
        for r in range(n):
            rng.shuffle(arms)
            for arm in arms:
                way = arm.split(" ")[0]
                times[arm].append(sum(step(model, opt, b) for b in epochs[way]))
            print(f"round {r + 1}/{n}: " + ", ".join(f"{a} {times[a][-1]:.1f} s" for a in sorted(times)), flush=True)
    return times, monitor


def report(lengths: list[int], epochs: dict[str, list[dict]], times: dict[str, list[float]], single: float,
           multi: float, monitor: Any) -> dict[str, Any]:
    import torch

    real = sum(lengths)
    base = statistics.median(times["padded-to-max"])
    rows = []
    print(f"\n{'way':<16}{'steps':>6}{'tokens computed':>17}{'real share':>12}{'epoch s':>9}{'real tok/s':>12}"
          f"{'vs padded':>11}")
    for way in WAYS:
        computed = sum(b["input_ids"].numel() for b in epochs[way])
        t = statistics.median(times[way])
        rows.append({"way": way, "steps": len(epochs[way]), "computed": computed, "real_share": real / computed,
                     "epoch_s": t, "real_tokens_per_s": real / t, "vs_padded": base / t})
        print(f"{way:<16}{len(epochs[way]):>6}{computed:>17,}{real / computed:>12.1%}{t:>9.2f}{real / t:>12,.0f}"
              f"{base / t:>10.2f}x")
    aa = statistics.median(a / b for a, b in zip(times["padded-to-max"], times["padded-to-max (A/A)"]))
    checks = [aa_check(statistics.median(times["padded-to-max"]), statistics.median(times["padded-to-max (A/A)"]),
                       what="padded-to-max epoch", ratio=aa),
              thread_check(single, multi, torch.get_num_threads(), what="padded-to-max step"),
              monitor.check("rounds")]
    packed = rows[-1]["vs_padded"]
    status = verdict(packed >= TARGET, checks)
    print("\n" + rules_text())
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'}  {c}")
    print(f"\n{status}: packed {packed:.2f}x the real tokens a second of padded-to-max (target >= {TARGET}x)"
          + (f"; {why(checks, brief=True)}" if why(checks) else ""))
    return {"ways": rows, "status": status, "packed_vs_padded": packed, "target": TARGET,
            "checks": [c.to_dict() for c in checks], "times": times}


if __name__ == "__main__":
    sys.exit(main())
