"""Data: built-in data sets, packing, fast decoding and loading (D1-D11); token rows batched without
padding (T39-T41).

Importing this package registers its tricks; heavy optional libraries (lmdb, h5py,
simplejpeg, cv2) load only when first used.
"""

from __future__ import annotations

from torch_tricks.data import (dataset, decode, loader, pack, prefetch, threads, token_batches,  # noqa: F401
                               transforms)  # (register tricks)
from torch_tricks.data.dataset import PackedDataset, collate_packed
from torch_tricks.data.decode import DecodeError, available_decoders, decode as decode_image, decode_crop, fastest_decoder
from torch_tricks.data.digits import DATASETS, load_dataset
from torch_tricks.data.formats import CorruptSampleError, PackError, is_complete, verify_pack
from torch_tricks.data.loader import make_loader, rebuild_loader, skip_failed
from torch_tricks.data.pack import PackReport, pack as pack_images
from torch_tricks.data.prefetch import Prefetcher
from torch_tricks.data.threads import ThreadLoader, keep_freed_heap, thread_loader
from torch_tricks.data.token_batches import pack_collate, pad_collate, token_loader
from torch_tricks.data.transforms import device_augment

__all__ = [
    "DATASETS", "load_dataset", "PackedDataset", "collate_packed", "DecodeError", "available_decoders",
    "decode_image", "fastest_decoder", "CorruptSampleError", "PackError", "is_complete", "verify_pack",
    "make_loader", "rebuild_loader", "skip_failed", "PackReport", "pack_images", "Prefetcher", "device_augment",
    "ThreadLoader", "thread_loader", "keep_freed_heap", "decode_crop", "pad_collate", "pack_collate", "token_loader",
]
