"""Tests for torch_tricks.train.checkpoint (catalogue T20, T26)."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
import torch
from torch import nn

from torch_tricks.errors import UserError
from torch_tricks.train.checkpoint import (
    LoadReport,
    latest_checkpoint,
    load_checkpoint,
    load_state_dict_flexible,
    save_checkpoint,
)
from torch_tricks.train.distributed import DistInfo, distributed_sampler

# --------------------------------------------------------------------------- helpers


def _net(seed: int, out: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.25), nn.Linear(8, out))


def _trainer(seed: int):
    model = _net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    return model, opt, sched, ema


_g = torch.Generator().manual_seed(11)
DATA = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=_g), torch.randn(24, 1, generator=_g))


def _loader(epoch: int):
    sampler = distributed_sampler(DATA, DistInfo(), shuffle=True, seed=3)
    sampler.set_epoch(epoch)
    # Its own generator: a DataLoader iterator draws its base seed when created, from the
    # global torch RNG unless given one, and a resumed run creates one more iterator.
    gen = torch.Generator().manual_seed(1000 + epoch)
    return torch.utils.data.DataLoader(DATA, batch_size=4, sampler=sampler, generator=gen)  # 6 batches an epoch


def _step(model, opt, sched, ema, x, y):
    # every generator plays a part: dropout and torch noise, numpy and python noise
    noise = 0.01 * (torch.randn_like(y) + float(np.random.randn()) + random.random())
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y + noise).backward()
    opt.step()
    sched.step()
    ema.update_parameters(model)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _state_equal(a: nn.Module, b: nn.Module) -> bool:
    """Same keys, same values; on the CPU (nn.DataParallel moves a module to cuda:0 where there is one)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


# --------------------------------------------------------------------------- round trip


def test_round_trip_resumes_mid_epoch_exactly(tmp_path):
    epochs, stop_epoch, stop_batch = 2, 1, 2

    _seed_all(0)
    ref, ref_opt, ref_sched, ref_ema = _trainer(1)
    for epoch in range(epochs):
        for x, y in _loader(epoch):
            _step(ref, ref_opt, ref_sched, ref_ema, x, y)

    _seed_all(0)
    model, opt, sched, ema = _trainer(1)
    step = 0
    for epoch in range(epochs):
        for i, (x, y) in enumerate(_loader(epoch)):
            if (epoch, i) == (stop_epoch, stop_batch):
                break
            _step(model, opt, sched, ema, x, y)
            step += 1
        else:
            continue
        break
    path = save_checkpoint(tmp_path / "run" / "last.pt", model=model, optimizer=opt, scheduler=sched, ema=ema,
                           step=step, epoch=stop_epoch, batch_index=stop_batch, sampler_epoch=stop_epoch,
                           extra={"note": torch.tensor([1.0])})
    assert path == tmp_path / "run" / "last.pt"
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp file left behind

    def resume(restore_rng: bool):
        # a new process, in effect: other weights, other RNG states
        _seed_all(123)
        model2, opt2, sched2, ema2 = _trainer(99)
        rep = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2, ema=ema2, restore_rng=restore_rng)
        for epoch in range(rep.epoch, epochs):
            for i, (x, y) in enumerate(_loader(epoch)):
                if epoch == rep.epoch and i < rep.batch_index:
                    continue  # batches this epoch already consumed before the save
                _step(model2, opt2, sched2, ema2, x, y)
        return rep, model2, opt2, ema2

    _, unseeded, _, _ = resume(restore_rng=False)
    assert not _state_equal(unseeded, ref)  # the control: without the RNG states the runs part
    rep, model2, opt2, ema2 = resume(restore_rng=True)
    assert isinstance(rep, LoadReport) and rep.complete
    assert rep.restored == ["model", "optimizer", "scheduler", "ema", "rng"]
    assert (rep.step, rep.epoch, rep.batch_index, rep.sampler_epoch) == (8, 1, 2, 1)
    assert torch.equal(rep.extra["note"], torch.tensor([1.0]))
    assert _state_equal(model2, ref), "resumed run diverged from the uninterrupted one"
    assert _state_equal(ema2, ref_ema)
    assert opt2.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for sa, sb in zip(opt2.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert "Resume at epoch 1, batch 2, step 8" in rep.summary() and "\n" not in rep.summary()


def test_scaler_and_counters_round_trip(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = _net(0)
    save_checkpoint(tmp_path / "c.pt", model=model, scaler=scaler, step=5, rng=False)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=1)
    rep = load_checkpoint(tmp_path / "c.pt", model=_net(1), scaler=scaler2, optimizer=opt)
    assert scaler2.get_scale() == 1024.0
    assert rep.restored == ["model", "scaler"] and rep.not_in_checkpoint == ["optimizer"] and rep.step == 5
    # a disabled scaler (an fp32 run) saves {}: resuming with fp16 starts a fresh scale instead of failing
    save_checkpoint(tmp_path / "c.pt", model=model, scaler=torch.amp.GradScaler("cpu", enabled=False), rng=False)
    rep = load_checkpoint(tmp_path / "c.pt", scaler=torch.amp.GradScaler("cpu"))
    assert rep.not_in_checkpoint == ["scaler"]


def test_wrapped_models_are_saved_unwrapped(tmp_path):
    base = _net(0)
    for wrapped in (nn.DataParallel(base), torch.compile(base)):
        save_checkpoint(tmp_path / "w.pt", model=wrapped, rng=False)
        keys = list(torch.load(tmp_path / "w.pt", weights_only=True)["model"])
        assert keys == list(base.state_dict()), keys
        plain = _net(5)
        plain.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True)["model"])  # plain torch works
        assert _state_equal(plain, base)


# --------------------------------------------------------------------------- prefixes, shapes


def test_dataparallel_prefixed_state_dict_loads_into_plain_model(tmp_path):
    src = _net(0)
    torch.save({f"module.{k}": v for k, v in src.state_dict().items()}, tmp_path / "dp.pth")  # a bare state_dict
    dst = _net(1)
    rep = load_checkpoint(tmp_path / "dp.pth", model=dst)
    assert rep.complete and sorted(rep.loaded) == sorted(src.state_dict())
    assert _state_equal(dst, src)
    assert rep.restored == ["model"] and rep.step == 0


def test_compiled_prefixed_state_dict_loads_into_plain_model_and_back():
    src = _net(0)
    compiled_sd = {f"_orig_mod.{k}": v for k, v in src.state_dict().items()}
    dst = _net(1)
    rep = load_state_dict_flexible(dst, compiled_sd)
    assert rep.complete and _state_equal(dst, src)
    # the other way: a plain state_dict into a compiled model and into a DDP/DP-wrapped one
    for target in (torch.compile(_net(2)), nn.DataParallel(_net(3))):
        rep = load_state_dict_flexible(target, src.state_dict(), strict=True)
        assert rep.complete
        inner = target._orig_mod if hasattr(target, "_orig_mod") else target.module
        assert _state_equal(inner, src)


def test_shape_mismatch_is_skipped_and_reported(tmp_path):
    src = _net(0, out=5)  # e.g. a head trained for 5 classes
    torch.save({"state_dict": src.state_dict(), "epoch": 4}, tmp_path / "other.pt")
    dst = _net(1, out=3)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(UserError, match="2 of another shape.*strict=False") as err:
        load_checkpoint(tmp_path / "other.pt", model=dst, strict=True)
    assert "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())  # strict failure touched nothing

    rep = load_checkpoint(tmp_path / "other.pt", model=dst)
    assert rep.skipped_shape == [("3.weight", (5, 8), (3, 8)), ("3.bias", (5,), (3,))]
    assert rep.loaded == ["0.weight", "0.bias"] and rep.missing == [] and rep.unexpected == []
    assert torch.equal(dst[0].weight, src[0].weight) and torch.equal(dst[3].weight, before["3.weight"])
    assert rep.epoch == 4 and not rep.complete
    assert "Skipped 2 with a different shape: 3.weight (checkpoint (5, 8) vs model (3, 8))" in rep.summary()


def test_missing_and_unexpected_keys_are_reported():
    src = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    sd = dict(src.state_dict())
    del sd["1.num_batches_tracked"]  # as in pre-0.4.1 checkpoints: not worth reporting
    del sd["0.bias"]
    sd["extra.weight"] = torch.zeros(1)
    rep = load_state_dict_flexible(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), sd)
    assert rep.missing == ["0.bias"] and rep.unexpected == ["extra.weight"]


def test_optimizer_that_does_not_fit_is_a_user_error(tmp_path):
    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    save_checkpoint(tmp_path / "o.pt", model=model, optimizer=opt, rng=False)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UserError, match="optimizer state .* does not fit.*optimizer=None"):
        load_checkpoint(tmp_path / "o.pt", optimizer=other)


# --------------------------------------------------------------------------- Python 2 pickles


class _Py2Pickler(pickle._Pickler):
    """Pickles ``str`` as Python 2 pickled its byte strings: SHORT_BINSTRING / BINSTRING opcodes
    holding the raw (here latin1) bytes. Python 3 decodes those opcodes with the unpickler's
    ``encoding``, ASCII/UTF-8 by default, which fails on the non-ASCII byte 0xe9."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_str(self, obj):
        try:
            data = obj.encode("latin1")
        except UnicodeEncodeError:
            return pickle._Pickler.save_str(self, obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + len(data).to_bytes(4, "little") + data)
        self.memoize(obj)

    dispatch[str] = save_str


def _write_py2_checkpoint(path, obj):
    """torch's legacy (pre-zip) format, every string pickled in Python 2 style, protocol 2."""
    mod = types.SimpleNamespace(
        __name__="py2_pickle", Pickler=_Py2Pickler, dump=lambda o, f, protocol=2: _Py2Pickler(f, protocol).dump(o)
    )
    torch.save(obj, path, pickle_module=mod, pickle_protocol=2, _use_new_zipfile_serialization=False)


def test_python2_pickle_loads_with_latin1(tmp_path):
    src = _net(0)
    path = tmp_path / "py2.pth"
    _write_py2_checkpoint(path, {"state_dict": src.state_dict(), "arch": "r\xe9snet", "epoch": 7})
    raw = path.read_bytes()
    assert pickle.SHORT_BINSTRING + b"\x06r\xe9snet" in raw  # a py2 byte string that is not UTF-8

    with pytest.raises(UserError, match="not UTF-8: if Python 2 saved it, pass encoding='latin1'") as err:
        load_checkpoint(path, model=_net(1))  # the default: weights_only=True, no encoding
    assert str(path) in str(err.value) and "\n" not in str(err.value)

    dst = _net(1)
    rep = load_checkpoint(path, model=dst, weights_only=False, encoding="latin1")
    assert rep.complete and rep.epoch == 7 and _state_equal(dst, src)
    with pytest.raises(UserError, match="not UTF-8"):
        load_checkpoint(path, model=_net(1), weights_only=False)


# --------------------------------------------------------------------------- broken files


def test_truncated_missing_empty_and_garbage_files_are_user_errors(tmp_path):
    good = save_checkpoint(tmp_path / "good.pt", model=_net(0))
    data = good.read_bytes()
    cases = {
        "truncated.pt": data[: len(data) // 2],
        "empty.pt": b"",
        "garbage.pt": b"this is not a checkpoint at all" * 10,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError) as err:
            load_checkpoint(tmp_path / name, model=_net(0))
        msg = str(err.value)
        assert str(tmp_path / name) in msg and "\n" not in msg, msg
        assert ("corrupt or truncated" in msg) or ("empty" in msg), msg
    with pytest.raises(UserError, match="does not exist") as err:
        load_checkpoint(tmp_path / "nope.pt")
    assert str(tmp_path / "nope.pt") in str(err.value)
    with pytest.raises(UserError, match="directory"):
        load_checkpoint(tmp_path)


def test_weights_only_refusal_names_the_way_out(tmp_path):
    torch.save({"model": _net(0).state_dict(), "cfg": types.SimpleNamespace(a=1)}, tmp_path / "obj.pt")
    with pytest.raises(UserError, match="types.SimpleNamespace.*weights_only=False"):
        load_checkpoint(tmp_path / "obj.pt", model=_net(0))
    rep = load_checkpoint(tmp_path / "obj.pt", model=_net(0), weights_only=False)
    assert rep.complete


# --------------------------------------------------------------------------- interrupted saves


def test_exception_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = _net(0)
    path = save_checkpoint(tmp_path / "ckpt.pt", model=old)
    real_save = torch.save

    def half_then_fail(obj, f, *a, **kw):
        import io

        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(path, model=_net(1))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # the temp file was removed
    dst = _net(2)
    assert load_checkpoint(path, model=dst).complete and _state_equal(dst, old)


_KILLED_SAVER = textwrap.dedent(
    """
    import io, sys, time, pathlib, torch
    from torch import nn
    from torch_tricks.train.checkpoint import save_checkpoint
    path, ready = sys.argv[1], pathlib.Path(sys.argv[2])
    real_save = torch.save
    def stall_half_way(obj, f, *a, **kw):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        ready.write_text("half written")
        time.sleep(120)  # the parent SIGKILLs us here, in the middle of the save
    torch.save = stall_half_way
    torch.manual_seed(1)
    save_checkpoint(path, model=nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)))
    """
)


def _kill_mid_save(script: str, path, ready) -> None:
    """Run ``script`` (a saver that touches ``ready`` in the middle of its save) and SIGKILL it there."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, f"saver exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "saver never reached the middle of its save"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    old = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    path = save_checkpoint(tmp_path / "ckpt.pt", model=old)
    old_bytes = path.read_bytes()
    ready = tmp_path / "ready.flag"
    _kill_mid_save(_KILLED_SAVER, path, ready)
    ready.unlink()

    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].name.startswith(".ckpt.pt.")  # the half-written temp file stays...
    assert path.read_bytes() == old_bytes  # ...but the real name still holds the old, whole checkpoint
    dst = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    assert load_checkpoint(path, model=dst).complete and _state_equal(dst, old)
    os.utime(temps[0], ns=(time.time_ns() + 10**10, time.time_ns() + 10**10))  # even if it is the newest file
    assert latest_checkpoint(tmp_path) == path
    assert latest_checkpoint(tmp_path, pattern="*") == path
    assert latest_checkpoint(tmp_path, pattern="*.tmp") is None

    # the next successful save clears stale temp files of the same checkpoint
    os.utime(temps[0], (time.time() - 3600, time.time() - 3600))
    save_checkpoint(path, model=old)
    assert not temps[0].exists()


def test_latest_checkpoint_picks_newest_complete_file(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None
    now = time.time()
    for i, name in enumerate(["step_9.pt", "step_10.pt", "step_2.pt"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (now - 100 + i, now - 100 + i))
    assert latest_checkpoint(tmp_path).name == "step_2.pt"  # by time
    for name in ["step_9.pt", "step_10.pt", "step_2.pt"]:
        os.utime(tmp_path / name, (now, now))
    assert latest_checkpoint(tmp_path).name == "step_10.pt"  # a tie: natural name order
    (tmp_path / "step_11.pt").write_bytes(b"")  # empty: never a checkpoint
    (tmp_path / ".step_12.pt.abc.tmp").write_bytes(b"x")
    assert latest_checkpoint(tmp_path).name == "step_10.pt"
    with pytest.raises(UserError, match="not a directory"):
        latest_checkpoint(tmp_path / "step_9.pt")


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(UserError, match="nn.Module"):
        save_checkpoint(tmp_path / "x.pt", model={"a": 1})
    with pytest.raises(UserError, match="directory"):
        save_checkpoint(tmp_path, model=_net(0))
    with pytest.raises(UserError, match="optimizer has no state_dict"):
        save_checkpoint(tmp_path / "x.pt", model=_net(0), optimizer=object())


def test_registered():
    from torch_tricks.registry import get_trick

    t = get_trick("safe_checkpoint")
    assert t.ids == ("T20", "T26") and t.kind == "train" and t.config_key == "checkpoint_dir"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


@requires_cuda
@pytest.mark.cuda
def test_cuda_checkpoint_loads_on_cpu_and_restores_cuda_rng(tmp_path):
    model = _net(0).cuda()
    torch.cuda.manual_seed_all(5)
    path = save_checkpoint(tmp_path / "gpu.pt", model=model)
    expected = torch.rand(3, device="cuda")
    cpu_model = _net(1)
    rep = load_checkpoint(path, model=cpu_model)  # map_location="cpu": nothing lands on cuda:0
    assert rep.complete and all(p.device.type == "cpu" for p in cpu_model.parameters())
    assert torch.equal(torch.rand(3, device="cuda"), expected)  # the CUDA generator came back


# --------------------------------------------------------------------------- keeping the last k (issue 16)


def _names(d):
    return sorted(p.name for p in d.iterdir())


def _save_steps(path, steps, keep):
    for step in steps:
        save_checkpoint(path, model=_net(step), step=step, keep=keep)


def test_keep_k_leaves_exactly_the_last_k_complete_checkpoints(tmp_path):
    path = tmp_path / "last.pt"
    _save_steps(path, range(1, 7), keep=3)  # 6 saves
    assert _names(tmp_path) == ["last.pt", "last.step-00000004.pt", "last.step-00000005.pt"]  # no temp files
    from torch_tricks.train.checkpoint import previous_checkpoints

    assert [p.name for p in previous_checkpoints(path)] == ["last.step-00000005.pt", "last.step-00000004.pt"]
    for name, step in [("last.pt", 6), ("last.step-00000005.pt", 5), ("last.step-00000004.pt", 4)]:
        dst = _net(99)
        rep = load_checkpoint(tmp_path / name, model=dst)
        assert rep.step == step and _state_equal(dst, _net(step)), name  # each a whole, separate checkpoint
    assert latest_checkpoint(tmp_path) == path  # the kept copies are older
    save_checkpoint(path, model=_net(6), step=6, keep=3)  # the same step again: not kept twice
    assert _names(tmp_path) == ["last.pt", "last.step-00000004.pt", "last.step-00000005.pt"]
    save_checkpoint(path, model=_net(7), step=7, keep=2)  # a smaller keep prunes
    assert _names(tmp_path) == ["last.pt", "last.step-00000006.pt"]
    save_checkpoint(path, model=_net(8), step=8)  # keep=1, the default: one file, as before
    assert _names(tmp_path) == ["last.pt"]
    _save_steps(tmp_path / "all.pt", range(1, 5), keep=0)  # 0 keeps all
    assert [n for n in _names(tmp_path) if n.startswith("all")] == [
        "all.pt", "all.step-00000001.pt", "all.step-00000002.pt", "all.step-00000003.pt"]
    with pytest.raises(UserError, match="keep must be"):
        save_checkpoint(path, model=_net(0), keep=-1)


def test_a_kept_copy_never_wins_a_time_tie(tmp_path):
    _save_steps(tmp_path / "last.pt", [1, 2], keep=2)
    now = time.time_ns()
    for name in ("last.pt", "last.step-00000001.pt"):  # file times are coarse: two saves can share one
        os.utime(tmp_path / name, ns=(now, now))
    assert latest_checkpoint(tmp_path) == tmp_path / "last.pt"


def test_failed_save_with_keep_leaves_the_previous_ones_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    _save_steps(path, [1, 2, 3], keep=2)
    before = {n: (tmp_path / n).read_bytes() for n in _names(tmp_path)}
    assert sorted(before) == ["last.pt", "last.step-00000002.pt"]
    real_save, real_replace = torch.save, os.replace

    def half_then_fail(obj, f, *a, **kw):
        import io

        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", half_then_fail)  # dies while writing the new one
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(path, model=_net(4), step=4, keep=2)
    monkeypatch.undo()
    assert {n: (tmp_path / n).read_bytes() for n in _names(tmp_path)} == before

    def fail_on_kept_name(src, dst, *a, **kw):
        if ".step-" in os.fspath(dst):
            raise OSError("disk went away")
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", fail_on_kept_name)  # dies while giving the previous one its kept name
    with pytest.raises(OSError, match="went away"):
        save_checkpoint(path, model=_net(4), step=4, keep=2)
    monkeypatch.undo()
    assert {n: (tmp_path / n).read_bytes() for n in _names(tmp_path)} == before  # no temp file, nothing lost


_KILLED_KEEPING_SAVER = _KILLED_SAVER.replace("save_checkpoint(path, model=",
                                              "save_checkpoint(path, keep=2, step=9, model=")


def test_sigkill_mid_save_with_keep_leaves_the_previous_ones_intact(tmp_path):
    path = tmp_path / "last.pt"
    _save_steps(path, [1, 2, 3], keep=2)
    before = {n: (tmp_path / n).read_bytes() for n in _names(tmp_path)}
    ready = tmp_path.parent / f"{tmp_path.name}.ready"
    _kill_mid_save(_KILLED_KEEPING_SAVER, path, ready)
    after = {n: (tmp_path / n).read_bytes() for n in _names(tmp_path) if not n.endswith(".tmp")}
    assert after == before
    os.utime(next(tmp_path.glob(".last.pt.*.tmp")), (time.time() - 3600, time.time() - 3600))
    save_checkpoint(path, model=_net(4), step=4, keep=2)  # the next save clears the stale temp file
    assert _names(tmp_path) == ["last.pt", "last.step-00000003.pt"]


def test_fallback_loads_the_newest_checkpoint_that_loads(tmp_path):
    path = tmp_path / "last.pt"
    _save_steps(path, [1, 2, 3], keep=3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # damaged after it was written
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_checkpoint(path, model=_net(0))  # without fallback: as before
    dst = _net(0)
    rep = load_checkpoint(path, model=dst, fallback=True)
    assert rep.path == str(tmp_path / "last.step-00000002.pt") and rep.step == 2 and _state_equal(dst, _net(2))
    assert [p for p, _ in rep.unreadable] == [str(path)]
    line = rep.fallback_line()
    assert "\n" not in line and str(path) in line and "corrupt or truncated" in line
    assert "last.step-00000002.pt (step 2)" in line and line in rep.summary()

    (tmp_path / "last.step-00000002.pt").write_bytes(b"not a checkpoint" * 4)  # the next one too
    rep = load_checkpoint(path, model=_net(0), fallback=True)
    assert rep.step == 1 and len(rep.unreadable) == 2 and "1 newer kept one" in rep.fallback_line()

    path.unlink()  # a missing last.pt falls back as well
    rep = load_checkpoint(path, model=_net(0), fallback=True)
    assert rep.step == 1 and rep.unreadable[0] == (str(path), "is missing")

    (tmp_path / "last.step-00000001.pt").write_bytes(b"garbage" * 10)  # none loads: one line, what to do
    path.write_bytes(data[:100])
    with pytest.raises(UserError) as err:
        load_checkpoint(path, model=_net(0), fallback=True)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "corrupt or truncated" in msg
    assert "use another checkpoint" in msg and "the 2 earlier checkpoints kept beside it do not load either" in msg

    alone = tmp_path / "alone" / "last.pt"  # nothing kept: exactly the error of old
    alone.parent.mkdir()
    alone.write_bytes(data[:100])
    with pytest.raises(UserError) as err2:
        load_checkpoint(alone, model=_net(0), fallback=True)
    with pytest.raises(UserError) as err1:
        load_checkpoint(alone, model=_net(0))
    assert str(err1.value) == str(err2.value)


def test_a_kept_sharded_checkpoint_is_resumed_when_the_pointed_one_is_incomplete(tmp_path):
    """save_sharded keeps the newest ``keep`` complete folders; a resume over a pointer whose folder lost
    its .metadata falls back to the previous one, in one warning (one process: DCP needs no group)."""
    from torch_tricks.train import TrainConfig, fit
    from torch_tricks.train.sharded_checkpoint import complete_sharded, save_sharded, sharded_to_resume

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        save_sharded(tmp_path, model=model, optimizer=opt, step=step, keep=2)
    assert [f.name for f in complete_sharded(tmp_path)] == ["step-00000003.dcp", "step-00000002.dcp"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002.dcp", "step-00000003.dcp"]
    assert sharded_to_resume(tmp_path) == (tmp_path / "step-00000003.dcp", "")
    (tmp_path / "step-00000003.dcp" / ".metadata").unlink()
    folder, note = sharded_to_resume(tmp_path)
    assert folder == tmp_path / "step-00000002.dcp" and "\n" not in note and "step-00000003.dcp" in note

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    cfg = TrainConfig(epochs=1, optimizer="adamw", progress=False, device="cpu", checkpoint_dir=str(tmp_path),
                      resume=True)
    with pytest.warns(UserWarning, match="missing or incomplete: resuming from .*step-00000002.dcp"):
        h = fit(model, batches, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)  # as saved
    assert h.resumed_from_step == 2 and h.resumed_from == str(folder) and h.notes == [note]
    save_sharded(tmp_path, model=model, optimizer=opt, step=9, keep=1)  # keep=1: the others go
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000009.dcp"]
