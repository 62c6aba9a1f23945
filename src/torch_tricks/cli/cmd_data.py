"""``pack`` and ``loader-tune``: pack a folder of images once, then read it fast."""

from __future__ import annotations

import argparse
from typing import Any

from torch_tricks.cli.common import add_common, emit


def add_commands(sub: Any) -> None:
    sp = sub.add_parser("pack", help="pack an image folder / list file once into LMDB or our memory-mapped format")
    sp.add_argument("src", help="ImageFolder tree (root/<class>/<image>) or a list file of 'path label' lines")
    sp.add_argument("dst", help="directory to write the pack to")
    sp.add_argument("--format", dest="fmt", choices=["native", "lmdb"], default="native",
                    help="native: memory-mapped shards (default); lmdb: an LMDB store")
    sp.add_argument("--storage", choices=["encoded", "jpeg", "raw"], default=None,
                    help="encoded: the source bytes; jpeg: re-encoded at --quality; raw: decoded uint8, "
                         "no decode at read time (default: jpeg with --resize, else encoded)")
    sp.add_argument("--resize", type=int, metavar="N", help="shorter side to N pixels, keeping the aspect (D1)")
    sp.add_argument("--raw-size", type=int, metavar="N",
                    help="raw storage: shorter side to N then center crop NxN, so batches read as one array")
    sp.add_argument("--quality", type=int, default=90, help="JPEG quality for --storage jpeg (default 90)")
    sp.add_argument("--no-crop-ready", dest="crop_ready", action="store_false",
                    help="--storage jpeg: plain JPEGs, without the restart markers and MCU offsets that let "
                         "crops decode only what they cover (~6%% smaller)")
    sp.add_argument("--workers", type=int, help="packing processes (default: the usable cores)")
    sp.add_argument("--no-resume", dest="resume", action="store_false",
                    help="start over instead of carrying on an interrupted pack")
    sp.add_argument("--overwrite", action="store_true", help="replace a complete pack at DST")
    add_common(sp, progress=True)
    sp.set_defaults(func=cmd_pack)

    sp = sub.add_parser("loader-tune", help="time the data loader over workers x batch sizes; I/O- or decode-bound?")
    sp.add_argument("path", help="a pack (from `torch-tricks pack`), an ImageFolder tree, an HDF5 file, or a token "
                                 "set (a saved data set folder, FILE.jsonl or FILE.parquet of input_ids or text)")
    sp.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer folder for a token set's text column")
    sp.add_argument("--batch", type=int, action="append", metavar="N", help="batch size to try (repeatable; default 64)")
    sp.add_argument("--workers", type=int, action="append", metavar="N",
                    help="worker count to try (repeatable; default 0, 1, 2, 4 ... up to the cores)")
    sp.add_argument("--seconds", type=float, default=2.0, help="seconds per trial (default 2)")
    sp.add_argument("--device", default="cpu", help="cpu or cuda: cuda pins memory and copies batches over")
    sp.add_argument("--warm", action="store_true", help="keep the page cache when measuring the read rate")
    add_common(sp, progress=True)
    sp.set_defaults(func=cmd_loader_tune)


def cmd_pack(args: argparse.Namespace) -> int:
    from torch_tricks.data.pack import pack

    storage = args.storage or ("jpeg" if args.resize else "encoded")
    report = pack(args.src, args.dst, fmt=args.fmt, storage=storage, resize=args.resize, raw_size=args.raw_size,
                  quality=args.quality, crop_ready=args.crop_ready, workers=args.workers, progress=args.progress,
                  resume=args.resume, overwrite=args.overwrite)
    emit(args, report.to_dict(), report.to_text())
    return 0


def cmd_loader_tune(args: argparse.Namespace) -> int:
    from torch_tricks.data.loader_tune import tune_loader_path

    r = tune_loader_path(args.path, batch_sizes=args.batch or (64,), workers=args.workers,
                         seconds_per_trial=args.seconds, device=args.device, progress=args.progress,
                         cold_read=not args.warm, tokenizer=args.tokenizer)
    emit(args, r.to_dict(), r.to_text())
    return 0
