"""T18 sharded: ``distributed = zero1`` (DDP + ZeroRedundancyOptimizer) and ``fsdp`` (FSDP2
``fully_shard`` per repeated block) on 2 ranks (gloo, CPU) end with the parameters of a
single-process run on the same global batches (atol 1e-5), plain and with checkpointing +
accumulate=2; bad use is one line."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import torchrun_launch as T
from test_train_fit_ddp import PER_RANK, SEED, dataset, global_batches  # the same data, the same order
from torch_tricks.errors import UserError
from torch_tricks.train.sharded_checkpoint import POINTER, last_sharded

VARIANTS = {"plain": {}, "checkpointing-accumulate2": {"checkpointing": "blocks", "accumulate": 2},
            "ema": {"ema": True, "ema_decay": 0.9}}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Sequential(Block(16), Block(16), Block(16)), nn.Linear(16, 3))


def config(**kw):
    from torch_tricks.train import TrainConfig

    return TrainConfig(**{"epochs": 2, "batch_size": PER_RANK, "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01,
                          "seed": SEED, "progress": False, "device": "cpu", **kw})


RESUME_PER_RANK, RESUME_STOP = 4, 3  # 8 steps per epoch on 2 ranks; stopped after 3: mid-epoch


def resume_config(**kw):
    return config(**{"epochs": 1, "batch_size": RESUME_PER_RANK, "log_every": 1, **kw})


MODES = ("zero1", "fsdp")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The module's torchrun work in 4 launches rather than 13 (a launch costs seconds before any work: the
    launcher and both ranks import torch). One launch runs every script that runs through (the sharded fits,
    fsdp against ddp, the uninterrupted runs the resumes are compared with, the own-loop runs that save
    mid-run), one per mode is killed while saving, and one runs every resume. What a killed run left on disk
    is read before anything touches it."""
    T.need_gloo()
    base = tmp_path_factory.mktemp("sharded")
    dirs = {m: {part: base / f"{part}-{m}" for part in ("fit", "resume", "tricks")} for m in MODES}
    for d in dirs.values():
        for folder in d.values():
            folder.mkdir()
    first: list[str] = ["fsdp_vs_ddp.py", str(base / "fsdp_vs_ddp.pt")]
    for m, d in dirs.items():
        first += ["---", "fit_sharded.py", m, str(d["fit"])]
        first += ["---", "fit_sharded_resume.py", "whole", str(d["resume"] / "ck_whole"), str(d["resume"] / "whole.pt"), m]
        first += ["---", "tricks_sharded_save.py", m, "run", str(d["tricks"])]
    # a checkpoint every step; rank 0 killed (SIGKILL) while saving the next one, after every rank's shards are
    # written and before the pointer moves to them: the previous checkpoint is the one to load. These launches
    # need nothing of the first one's: all three run at once (what one waits on, another computes)
    kills = {m: T.start(T.SCRIPTS / "fit_sharded_resume.py", "killsave", str(d["resume"] / "ck"),
                       str(d["resume"] / "stop.pt"), m) for m, d in dirs.items()}
    log = T.run(T.SCRIPTS / "run_jobs.py", *first, timeout=480)
    killed, saved = {}, {}
    for m, d in dirs.items():
        T.wait(kills[m], ok=False)
        ck = d["resume"] / "ck"
        killed[m] = _left_by_the_kill(ck)
        shutil.copytree(ck, d["resume"] / "ck_one")
        saved[m] = last_sharded(d["tricks"] / "ckpt")
    last: list[str] = []
    for m, d in dirs.items():
        last += ["fit_sharded_resume.py", "resume", str(d["resume"] / "ck"), str(d["resume"] / "resume.pt"), m, "---"]
        last += ["tricks_sharded_save.py", m, "resume", str(d["tricks"]), "---"]
    T.run(T.SCRIPTS / "run_jobs.py", *last[:-1], timeout=480)
    return SimpleNamespace(dirs=dirs, log=log, killed=killed, tricks_saved=saved, fsdp_vs_ddp=base / "fsdp_vs_ddp.pt")


def _left_by_the_kill(ck: Path) -> dict:
    """What a run killed while saving left in ``ck``; then a save killed earlier still is planted beside it."""
    folder = last_sharded(ck)
    facts = {"last": folder.name if folder else None, "last.pt": (ck / "last.pt").exists(),
             "killed in": (ck / f"step-{RESUME_STOP + 1:08d}.dcp").is_dir(),
             "pointer.tmp": (ck / (POINTER + ".tmp")).is_file()}
    half = ck / f"step-{RESUME_STOP + 2:08d}.dcp"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half a shard")
    facts["last, beside a half save"] = last_sharded(ck) == folder
    return facts


@pytest.mark.parametrize("mode", MODES)
def test_sharded_fit_on_two_ranks_equals_single_process(launched, mode):
    out = launched.dirs[mode]["fit"]
    assert (out / "done").exists(), launched.log[-3000:]

    from torch_tricks.train import fit

    for name, extra in VARIANTS.items():
        sharded = torch.load(out / f"{name}.pt")
        single = make_model()
        h = fit(single, global_batches(), dataset(), config=config(**extra).replace(epochs=1))  # the list: both epochs
        for k, v in single.state_dict().items():
            torch.testing.assert_close(sharded[k].to(v.dtype), v, rtol=0, atol=1e-5, msg=f"{name}: {k}")
        if extra.get("ema"):  # the average of the sharded parameters, evaluated on the ranks' validation shards
            assert h.final["loss_ema"] == pytest.approx(sharded["final"]["loss_ema"], rel=1e-5)


def test_fsdp_with_channels_last_and_with_bf16_batchnorm_trains_as_ddp_does(launched):
    """Two switches FSDP2 needs wiring for (both found by the tune's distributed rows): channels_last weights
    are not contiguous, so under fsdp the inputs alone go channels_last; under bf16 BatchNorm's running
    statistics stay fp32, so BatchNorm is sharded on its own in fp32. Each run equals DDP's (atol 1e-5).
    And the NaN guard's decision is every rank's under fsdp and zero1 as under ddp."""
    out = torch.load(launched.fsdp_vs_ddp)
    assert "channels_last=inputs" in out["channels_last", "fsdp"]["applied"]
    assert "channels_last" in out["channels_last", "ddp"]["applied"]
    assert "precision=bf16" in out["bf16-batchnorm", "fsdp"]["applied"]
    for variant in ("channels_last", "bf16-batchnorm"):
        ddp, fsdp = out[variant, "ddp"], out[variant, "fsdp"]
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5), variant
        for k, v in ddp["params"].items():
            torch.testing.assert_close(fsdp["params"][k].contiguous(), v.contiguous(), rtol=0, atol=1e-5,
                                       msg=f"{variant}: {k}")
    for mode in ("fsdp", "zero1"):  # a NaN loss on rank 1 alone: both ranks stop at step 2, neither hangs
        assert [s for s, _ in out["nan", mode]] == [2, 2], out["nan", mode]
        assert all("at step 2" in msg for _, msg in out["nan", mode])


@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp"])
def test_a_sharded_mode_without_torchrun_is_one_line(mode, monkeypatch, capsys):
    from torch_tricks import Tricks
    from torch_tricks.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match=f"distributed = {mode} needs several processes: launch with `torchrun"):
        Tricks({"distributed": mode, "device": "cpu"})
    assert main(["train", "--model", "small_cnn", "--data", "digits", "--distributed", mode, "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs several processes" in err, err


def test_unknown_distributed_mode_is_a_config_error():
    from torch_tricks.train import TrainConfig

    with pytest.raises(UserError, match="distributed must be auto, ddp, zero1, fsdp or off, not 'zero3'"):
        TrainConfig(distributed="zero3").validate()


def _train_losses(h):
    return [(r["step"], r["loss"]) for r in h.rows if r["split"] == "train"]


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_of_two_ranks_resumes_on_two_ranks_and_on_one(launched, mode):
    """fsdp or zero1 on 2 ranks write DCP checkpoints (every rank its shards); killed while saving mid-epoch,
    the previous one resumes on 2 ranks (rank 0's losses and the parameters of the uninterrupted run) and in
    one plain process on the same global batches (the losses of a single-process run on them, rel 1e-5; its
    parameters)."""
    from torch_tricks.train import fit

    tmp_path = launched.dirs[mode]["resume"]
    killed = launched.killed[mode]
    assert killed["last"] == f"step-{RESUME_STOP:08d}.dcp"
    assert not killed["last.pt"]  # no rank gathered the whole state
    assert killed["killed in"]  # the save it was killed in
    assert killed["pointer.tmp"]  # the pointer it never moved
    assert killed["last, beside a half save"]  # and a save killed earlier still is passed over

    whole = torch.load(tmp_path / "whole.pt")
    two = torch.load(tmp_path / "resume.pt")
    assert two["resumed_from"] == RESUME_STOP
    tail = [x for x in whole["losses"] if x[0] > RESUME_STOP]
    assert [s for s, _ in two["losses"]] == [s for s, _ in tail]
    for (_, a), (_, b) in zip(two["losses"], tail):
        assert a == pytest.approx(b, rel=1e-5)
    for k, v in whole["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=0, atol=1e-5, msg=k)

    # one plain process, fed the global batches the two ranks saw together
    batches = global_batches(RESUME_PER_RANK, epochs=1)
    reference = _train_losses(fit(make_model(), batches, config=resume_config()))
    single = make_model()
    h = fit(single, batches, config=resume_config(checkpoint_dir=str(tmp_path / "ck_one"), resume=True))
    assert h.resumed_from_step == RESUME_STOP
    mine = _train_losses(h)
    assert [s for s, _ in mine] == [s for s, _ in reference if s > RESUME_STOP]
    for (_, a), (_, b) in zip(mine, [x for x in reference if x[0] > RESUME_STOP]):
        assert a == pytest.approx(b, rel=1e-5)
    for k, v in whole["params"].items():
        torch.testing.assert_close(single.state_dict()[k], v, rtol=0, atol=1e-5, msg=k)


def tricks_batches(steps: int = 6):
    """Global batches of 8 for the own-loop test: rank r trains on rows 4r..4r+3 of each."""
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(steps)]


@pytest.mark.parametrize("mode", MODES)
def test_tricks_save_and_load_in_your_own_loop_under_sharding(launched, mode):
    """tricks.save on every rank mid-run (a DCP folder, every rank its shards), tricks.load in a fresh run on 2
    ranks and in one plain process: the remaining global losses are the uninterrupted run's (rel 1e-5) and so
    are the final parameters (atol 1e-5)."""
    import torch.nn.functional as F

    from torch_tricks import Tricks

    tmp_path = launched.dirs[mode]["tricks"]
    ckpt = tmp_path / "ckpt"
    assert (launched.tricks_saved[mode] / ".metadata").is_file()
    run, resumed = torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "resume.pt")
    assert sorted(run["losses"]) == [1, 2, 3, 4, 5, 6] and sorted(resumed["losses"]) == [4, 5, 6]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(run["losses"][step], rel=1e-5), step
    for k, v in run["params"].items():
        torch.testing.assert_close(resumed["params"][k], v, rtol=0, atol=1e-5, msg=k)

    tricks = Tricks({"distributed": "off", "device": "cpu", "optimizer": "adamw", "lr": 0.01, "seed": 0})
    model, _ = tricks.prepare(make_model())
    tricks.load(ckpt)  # written by 2 ranks, read by one process
    assert tricks.step_count == 3
    for i, (x, y) in enumerate(tricks_batches()[3:], start=4):
        with tricks.autocast():
            loss = F.cross_entropy(model(x), y)
        tricks.backward(loss)
        tricks.step()
        assert float(loss.detach()) == pytest.approx(run["losses"][i], rel=1e-5), i
    for k, v in run["params"].items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-5, msg=k)


def test_a_dcp_checkpoint_from_another_model_is_one_line(tmp_path):
    """Written by one plain process through save_sharded (DCP works without a process group)."""
    from torch_tricks.train import fit
    from torch_tricks.train.sharded_checkpoint import save_sharded

    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    save_sharded(tmp_path, model=model, optimizer=opt, step=1)
    other = nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3))
    with pytest.raises(UserError, match="does not fit this model and optimizer"):
        fit(other, global_batches(), config=config(checkpoint_dir=str(tmp_path), resume=True, epochs=1))
    (tmp_path / "last.dcp.json").write_text("{not json")
    with pytest.raises(UserError, match="last.dcp.json is damaged"):
        fit(make_model(), global_batches(), config=config(checkpoint_dir=str(tmp_path), resume=True, epochs=1))


def test_ckpt_export_turns_a_dcp_checkpoint_into_one_state_dict(tmp_path, capsys):
    from torch_tricks.cli import main
    from torch_tricks.train.sharded_checkpoint import save_sharded

    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    save_sharded(tmp_path / "ck", model=model, optimizer=opt, step=7)
    assert main(["ckpt", "export", str(tmp_path / "ck"), str(tmp_path / "model.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    fresh = make_model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: every key, no extra
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert main(["ckpt", "export", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint at" in err and not (tmp_path / "x.pt").exists()


def test_ckpt_export_prints_the_results_own_text(tmp_path, capsys):
    """``torch-tricks ckpt export`` prints export_checkpoint(...).to_text(); the result is still the plain
    dict it was, and --json prints it unchanged."""
    import json

    from torch_tricks._format import human_bytes
    from torch_tricks.cli import main
    from torch_tricks.train.sharded_checkpoint import export_checkpoint, save_sharded

    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    save_sharded(tmp_path / "ck", model=model, optimizer=opt, step=3)
    info = export_checkpoint(tmp_path / "ck", tmp_path / "a.pt")
    assert isinstance(info, dict) and set(info) == {"source", "out", "tensors", "numel", "bytes"}
    assert info.to_dict() == dict(info) and type(info.to_dict()) is dict
    assert main(["ckpt", "export", str(tmp_path / "ck"), str(tmp_path / "a.pt")]) == 0
    assert capsys.readouterr().out == info.to_text() + "\n"
    n = sum(p.numel() for p in model.state_dict().values())
    assert info.to_text() == (f"wrote {tmp_path / 'a.pt'}: {len(model.state_dict())} tensors, {n:,} values, "
                              f"{human_bytes(info['bytes'])}, from {info['source']}; load it with "
                              f"model.load_state_dict(torch.load({str(tmp_path / 'a.pt')!r}, weights_only=True))")
    assert main(["ckpt", "export", str(tmp_path / "ck"), str(tmp_path / "a.pt"), "--json"]) == 0
    assert capsys.readouterr().out == json.dumps(dict(info), indent=2) + "\n"
