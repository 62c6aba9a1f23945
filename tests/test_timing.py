"""Behaviour of torch_tricks.inspect.timing; never asserts absolute times."""

from __future__ import annotations

import pytest
import torch

from torch_tricks.errors import UserError
from torch_tricks.inspect.timing import Timing, benchmark, compare, format_seconds, synchronize


def test_benchmark_counts_warmup_and_repeats():
    calls = []
    t = benchmark(lambda x: calls.append(x), 7, warmup=2, repeats=5)
    assert calls == [7] * 7
    assert (t.warmup, t.repeats, len(t.times_s)) == (2, 5, 5)
    assert t.min_s <= t.median_s <= t.max_s
    assert t.min_s <= t.mean_s <= t.max_s
    assert t.iqr_s >= 0 and t.std_s >= 0
    assert all(s >= 0 for s in t.times_s)


def test_benchmark_passes_kwargs_and_runs_torch():
    seen = {}

    def fn(a, *, scale):
        seen["out"] = a * scale

    benchmark(fn, torch.ones(3), scale=2.0, warmup=0, repeats=1, device="cpu")
    assert torch.equal(seen["out"], torch.full((3,), 2.0))


def test_benchmark_min_time_extends_repeats():
    t = benchmark(lambda: sum(range(1000)), warmup=0, repeats=1, min_time_s=0.02)
    assert sum(t.times_s) >= 0.02
    assert t.repeats == len(t.times_s) > 1


@pytest.mark.parametrize(
    "kwargs",
    [dict(repeats=0), dict(repeats=1.5), dict(warmup=-1), dict(min_time_s=-1), dict(min_time_s=float("inf"))],
)
def test_benchmark_rejects_bad_arguments(kwargs):
    with pytest.raises(UserError):
        benchmark(lambda: None, **kwargs)


def test_benchmark_rejects_non_callable_and_bad_device():
    with pytest.raises(UserError):
        benchmark(42)
    with pytest.raises(UserError, match="device"):
        benchmark(lambda: None, device="not-a-device")


def test_compare_interleaves_round_robin():
    order: list[str] = []
    fns = {name: (lambda n=name: order.append(n)) for name in "abc"}
    res = compare(fns, warmup=1, repeats=4)
    assert list(res) == ["a", "b", "c"]
    assert all(r.repeats == 4 and r.warmup == 1 for r in res.values())
    assert order[:3] == ["a", "b", "c"]  # warm-up round
    timed = order[3:]
    assert len(timed) == 12
    rounds = [timed[i : i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)  # every round runs every candidate once
    assert [r[0] for r in rounds] == ["a", "b", "c", "a"]  # ...starting one place further along


def test_compare_rejects_bad_input():
    with pytest.raises(UserError):
        compare({})
    with pytest.raises(UserError):
        compare({"x": 1})
    with pytest.raises(UserError):
        compare({"x": lambda: None}, repeats=0)


def test_timing_stats_str_and_dict():
    t = Timing.from_times([0.010, 0.012, 0.011, 0.013, 0.100], warmup=3)
    assert t.median_s == pytest.approx(0.012)
    assert t.iqr_s == pytest.approx(0.002)
    assert (t.min_s, t.max_s, t.repeats) == (0.010, 0.100, 5)
    assert str(t) == "12 ms ± 1 (median ± IQR/2, n=5)"
    d = t.to_dict()
    assert d["times_s"] == t.times_s and d["warmup"] == 3
    assert "times_s" not in t.to_dict(include_times=False)
    fast = Timing.from_times([0.006])
    assert fast.iqr_s == 0 and fast.std_s == 0
    assert fast.ratio_to(t) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        Timing.from_times([])


def test_format_seconds_units():
    assert format_seconds(1.5) == "1.5 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(4.56e-5) == "45.6 us"
    assert format_seconds(7e-9) == "7 ns"


def test_synchronize_cpu_is_noop():
    synchronize()
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    with pytest.raises(UserError):
        synchronize("nonsense")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_synchronize_waits_for_cuda_kernels():
    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x  # queued asynchronously
    synchronize("cuda")
    assert torch.cuda.current_stream().query()  # nothing left in the stream
    synchronize()  # CUDA is initialised now, so None syncs it too
    t = benchmark(lambda: x @ x, warmup=1, repeats=3, device="cuda")
    assert t.repeats == 3 and t.min_s > 0
    del y


# -- the timed workloads on keyword inputs (a transformers model) ----------------------------------

def test_workloads_run_a_transformers_model_on_named_and_positional_inputs():
    transformers = pytest.importorskip("transformers")
    from torch_tricks.inspect.step import Workloads
    from torch_tricks.outputs import get_loss

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                                                 n_positions=16, use_cache=False))
    ids = torch.randint(0, 100, (2, 16))
    named = Workloads(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    positional = Workloads(model, ids)
    for wl in (named, positional):
        for fn in (wl.forward, wl.forward_backward, wl.step):
            t = benchmark(fn, warmup=1, repeats=2)
            assert t.repeats == 2 and len(t.times_s) == 2
    model.eval()
    assert torch.equal(named.forward().logits, positional.forward().logits)  # an all-ones mask changes nothing
    with_labels = Workloads(model, {"input_ids": ids, "labels": ids}, loss_fn=get_loss("auto"), target=ids)
    assert with_labels.loss().dim() == 0  # the model's own loss, from its labels


def test_timings_table_is_what_the_cli_time_prints(capsys, monkeypatch):
    import torch_tricks.inspect.timing as timing
    from torch_tricks.cli import main
    from torch_tricks.inspect.timing import timings_table

    made = []

    def fake_benchmark(fn, *, warmup, repeats, device):
        made.append(Timing.from_times([0.001 * (len(made) + 1)] * repeats, warmup))
        return made[-1]

    monkeypatch.setattr(timing, "benchmark", fake_benchmark)
    assert main(["time", "--model", "mlp", "--batch", "4", "--warmup", "1", "--repeats", "3"]) == 0
    results = dict(zip(["forward (eval, no_grad)", "forward+backward", "training step (sgd)"], made))
    text = timings_table(results, 4, title="mlp, batch 4, cpu")
    assert capsys.readouterr().out == text + "\n"
    assert text.splitlines()[0] == "mlp, batch 4, cpu (median of 3 after 1 warm-up):"
    assert text.splitlines()[3].split() == ["forward", "(eval,", "no_grad)", "1.00", "0.00", "4000.0"]
    assert "samples/s" not in timings_table(results) and "median of" not in timings_table(results)
