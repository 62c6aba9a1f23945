"""Checks run on 2 CPU processes with gloo, launched by tests/test_train_distributed.py via torchrun.

Usage: torchrun --standalone --nproc_per_node=2 dist_checks.py OUT_DIR
Each rank writes OUT_DIR/rank<r>.json: measured differences and flags; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from torch import nn

from torch_tricks.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from torch_tricks.train.distributed import (
    all_agree,
    all_reduce_sum,
    any_rank,
    barrier,
    cleanup,
    distributed_sampler,
    init_distributed,
    no_sync_if,
    reduce_mean,
    wrap_ddp,
)
from torch_tricks.train.syncbn import CPUSyncBatchNorm, convert_sync_batchnorm

torch.set_num_threads(1)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def check_syncbn(info, res):
    """(a) CPUSyncBatchNorm on each rank's part of a batch == one BatchNorm over the whole batch."""
    r, w = info.rank, info.world_size
    out = {}
    for kind, shape, split in (("2d", (8, 3, 4, 5), [4, 4]), ("1d_uneven", (9, 5), [3, 6])):
        torch.manual_seed(1)
        x = torch.randn(*shape) * 3 + 2
        g = torch.randn(*shape)
        c = shape[1]
        bn_cls = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
        ref = bn_cls(c, momentum=0.3)
        with torch.no_grad():
            ref.weight.copy_(torch.rand(c) + 0.5)
            ref.bias.copy_(torch.randn(c))
        sync = convert_sync_batchnorm(bn_cls(c, momentum=0.3))
        assert isinstance(sync, CPUSyncBatchNorm), type(sync)
        sync.load_state_dict(ref.state_dict())
        lo, hi = sum(split[:r]), sum(split[: r + 1])
        d = {"y": 0.0, "dx": 0.0, "dw": 0.0, "db": 0.0, "running_mean": 0.0, "running_var": 0.0, "eval": 0.0}
        for it in range(2):  # two steps: running stats updated twice
            xr = x.clone().requires_grad_(True)
            ref.zero_grad()
            yr = ref(xr)
            (yr * g).sum().backward()
            xs = x[lo:hi].clone().requires_grad_(True)
            sync.zero_grad()
            ys = sync(xs)
            (ys * g[lo:hi]).sum().backward()
            dw, db = sync.weight.grad.clone(), sync.bias.grad.clone()
            torch.distributed.all_reduce(dw)  # what DDP's gradient all-reduce does (sum; DDP then divides)
            torch.distributed.all_reduce(db)
            d["y"] = max(d["y"], maxdiff(ys, yr[lo:hi]))
            d["dx"] = max(d["dx"], maxdiff(xs.grad, xr.grad[lo:hi]))
            d["dw"] = max(d["dw"], maxdiff(dw, ref.weight.grad))
            d["db"] = max(d["db"], maxdiff(db, ref.bias.grad))
        d["running_mean"] = maxdiff(sync.running_mean, ref.running_mean)
        d["running_var"] = maxdiff(sync.running_var, ref.running_var)
        d["num_batches_tracked"] = int(sync.num_batches_tracked) - int(ref.num_batches_tracked)
        sync.eval()
        ref.eval()
        with torch.no_grad():
            d["eval"] = maxdiff(sync(x[lo:hi]), ref(x)[lo:hi])
        out[kind] = d
    res["syncbn"] = out


def _data(n=24):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))


def _model(bn: bool):
    torch.manual_seed(7)
    layers = [nn.Linear(6, 16)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Linear(16, 1)]
    return nn.Sequential(*layers)


def _reference(bn: bool, steps: int, global_batch: int):
    """Single process, full global batch: what DDP on 2 ranks must reproduce."""
    from torch_tricks.train.distributed import DistInfo

    ds = _data()
    model = _model(bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = distributed_sampler(ds, DistInfo(), shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=global_batch, sampler=sampler)
    for _, (x, y) in zip(range(steps), loader):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def check_ddp(info, res, tmp: Path):
    """(b) DDP on 2 ranks (each half the global batch) == one process on the full batch; plus SyncBN and no_sync."""
    steps, global_batch = 3, 8
    local = global_batch // info.world_size
    out = {}
    for variant in ("plain", "syncbn", "accumulate", "bn_unsynced"):
        bn = variant in ("syncbn", "bn_unsynced")  # bn_unsynced: the control, plain BN must NOT match
        ref = _reference(bn, steps, global_batch)
        ds = _data()
        model = wrap_ddp(_model(bn), info, sync_bn=variant == "syncbn")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = distributed_sampler(ds, info, shuffle=True, seed=5)
        loader = torch.utils.data.DataLoader(ds, batch_size=local, sampler=sampler)
        for _, (x, y) in zip(range(steps), loader):
            opt.zero_grad()
            if variant == "accumulate":  # 2 micro-batches; all-reduce only on the last
                micro = x.shape[0] // 2
                for m in range(2):
                    sl = slice(m * micro, (m + 1) * micro)
                    with no_sync_if(model, m < 1):
                        (nn.functional.mse_loss(model(x[sl]), y[sl]) / 2).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        inner = model.module
        diffs = [maxdiff(p, q) for p, q in zip(inner.parameters(), ref.parameters())]
        bufs = [maxdiff(p.float(), q.float()) for p, q in zip(inner.buffers(), ref.buffers())]
        out[variant] = {"param": max(diffs), "buffer": max(bufs) if bufs else 0.0,
                        "syncbn_used": any(isinstance(m, CPUSyncBatchNorm) for m in inner.modules())}
        if variant == "plain":
            trained, trained_opt = model, opt
    res["ddp"] = out
    check_checkpoint(info, res, tmp, trained, trained_opt)


def check_checkpoint(info, res, tmp: Path, model, opt):
    """(d) save on rank 0 + barrier, then every rank loads with map_location='cpu'."""
    path = tmp / "ckpt" / "step3.pt"
    torch.manual_seed(100 + info.rank)  # each rank its own RNG stream
    saved = save_checkpoint(path, model=model, optimizer=opt, step=3, epoch=1, batch_index=1, sampler_epoch=1)
    after_save = torch.rand(4)  # what this rank draws right after the save
    out = {"exists_after_return": saved.is_file(), "latest": str(latest_checkpoint(path.parent))}
    plain = _model(False)
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    rep = load_checkpoint(path, model=plain, map_location="cpu")
    out["plain_param"] = max(maxdiff(p, q) for p, q in zip(plain.parameters(), model.module.parameters()))
    out["plain_complete"] = rep.complete
    out["restored"] = rep.restored
    out["position"] = [rep.step, rep.epoch, rep.batch_index, rep.sampler_epoch]
    out["rng_same_stream"] = bool(torch.equal(torch.rand(4), after_save))
    draws = [None] * info.world_size
    torch.distributed.all_gather_object(draws, after_save.tolist())
    out["rng_ranks_differ"] = draws[0] != draws[1]
    # a plain checkpoint into a DDP-wrapped model (target keys carry "module.")
    fresh = wrap_ddp(_model(False), info)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    rep2 = load_checkpoint(path, model=fresh, optimizer=fresh_opt, map_location="cpu", restore_rng=False)
    out["ddp_param"] = max(maxdiff(p, q) for p, q in zip(fresh.module.parameters(), model.module.parameters()))
    out["ddp_complete"] = rep2.complete
    out["opt_restored"] = "optimizer" in rep2.restored
    m1 = [s["momentum_buffer"] for s in fresh_opt.state_dict()["state"].values()]
    m0 = [s["momentum_buffer"] for s in opt.state_dict()["state"].values()]
    out["momentum"] = max(maxdiff(a, b) for a, b in zip(m1, m0))
    barrier()
    res["checkpoint"] = out


def check_collectives(info, res):
    """(c) one rank's flag decides for all, identically."""
    r = info.rank
    res["collectives"] = {
        "any_rank_one_true": any_rank(r == 1),
        "all_agree_one_true": all_agree(r == 1),
        "all_agree_all_true": all_agree(True),
        "any_rank_all_false": any_rank(False),
        "reduce_mean": float(reduce_mean(torch.tensor(float(r)))),
        "reduce_mean_int": float(reduce_mean(torch.tensor(r))),
        "all_reduce_sum": all_reduce_sum(torch.tensor([r + 1, 10])).tolist(),
    }


def main() -> int:
    out_dir = Path(sys.argv[1])
    info = init_distributed(timeout=60, device="cpu")  # the CPU (gloo) paths, on a machine with GPUs too
    res = {"info": {"rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
                    "device": str(info.device), "is_main": info.is_main, "initialized": info.initialized,
                    "backend": info.backend}}
    try:
        check_collectives(info, res)
        check_syncbn(info, res)
        check_ddp(info, res, out_dir)
    except Exception:
        res["error"] = traceback.format_exc()
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(res, indent=1))
    cleanup()
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
