"""An HDF5 dataset that is safe with many DataLoader workers (catalogue D9).

An open ``h5py.File`` cannot be pickled, and an HDF5 handle inherited through ``fork``
shares library state with the parent, which corrupts reads. So the handle must be opened
in each worker, once, on first use: never in ``__init__`` (which runs in the main process
before the workers exist), and not on every ``__getitem__`` (opening costs far more than
reading one sample). :class:`HDF5Dataset` reads its length with a short-lived handle in
``__init__``, opens lazily, re-opens when it finds itself in a new process
(``os.getpid()`` changed), and drops the handle when pickled.

Needs ``h5py`` (the ``data`` extra).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from torch_tricks._io import atomic_path
from torch_tricks._optional import require
from torch_tricks.errors import UserError

__all__ = ["HDF5Dataset", "write_hdf5"]


class HDF5Dataset(Dataset):
    """Samples ``(image, label)`` from two HDF5 datasets of equal length (``labels_key=None``: images only).

    ``image`` is a tensor of the stored dtype and shape (uint8 HWC as stored by
    :func:`write_hdf5`); ``transform(image)`` is applied to it if given; ``label`` is an
    int. The file handle lives in ``_file`` and is ``None`` until the first sample is
    read in the current process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        images_key: str = "images",
        labels_key: str | None = "labels",
        transform: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        h5py = _h5py()
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise UserError(f"no HDF5 file at {self.path!r}")
        self.images_key = images_key
        self.labels_key = labels_key
        self.transform = transform
        try:
            with h5py.File(self.path, "r") as f:  # short-lived: only to learn the length
                if images_key not in f:
                    raise UserError(f"{self.path!r} has no dataset {images_key!r}: it has {', '.join(sorted(f.keys())) or 'none'}")
                self._len = int(f[images_key].shape[0])
                self.sample_shape = tuple(f[images_key].shape[1:])
                self.dtype = np.dtype(f[images_key].dtype)
                if labels_key is not None:
                    if labels_key not in f:
                        raise UserError(
                            f"{self.path!r} has no dataset {labels_key!r}: pass labels_key=None for images only"
                        )
                    if int(f[labels_key].shape[0]) != self._len:
                        raise UserError(
                            f"{self.path!r}: {images_key!r} has {self._len} rows but {labels_key!r} has {f[labels_key].shape[0]}"
                        )
        except OSError as exc:
            raise UserError(f"cannot read {self.path!r} as HDF5: {exc}") from None
        self._file: Any = None
        self._images: Any = None
        self._labels: Any = None
        self._pid: int | None = None
        self._inherited: list[Any] = []

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, torch.Tensor):
            index = int(index)
        if not -self._len <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        index %= self._len
        self._ensure_open()
        image = torch.from_numpy(np.asarray(self._images[index]))
        if self.transform is not None:
            image = self.transform(image)
        if self._labels is None:
            return image
        return image, int(self._labels[index])

    def files(self) -> list[str]:
        """The files holding the data (for storage read-rate measurements)."""
        return [self.path]

    def close(self) -> None:
        """Close this process's handle (the next sample opens it again)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = self._images = self._labels = None
        self._pid = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _images=None, _labels=None, _pid=None, _inherited=[])
        return state

    def _ensure_open(self) -> None:
        pid = os.getpid()
        if self._file is not None and self._pid == pid:
            return
        if self._file is not None:
            # Inherited through fork: the parent owns it. Keep the object alive rather than
            # closing it here, so nothing in this process touches the shared HDF5 state.
            self._inherited.append(self._file)
        h5py = _h5py()
        self._file = h5py.File(self.path, "r")
        self._images = self._file[self.images_key]
        self._labels = self._file[self.labels_key] if self.labels_key is not None else None
        self._pid = pid

    def __repr__(self) -> str:
        return f"HDF5Dataset({self.path!r}, {self._len} samples of {self.sample_shape} {self.dtype})"


def write_hdf5(
    data: Dataset[Any] | tuple[Any, Any] | Any,
    path: str | os.PathLike[str],
    *,
    images_key: str = "images",
    labels_key: str = "labels",
    compression: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Write images (and labels) to ``path`` atomically; returns what was written.

    ``data`` is ``(images, labels)`` arrays/tensors (``labels`` may be ``None``), an
    images array alone, or a map-style dataset of ``(image, label)`` (or bare images)
    whose images all have one shape. Images keep their dtype (store uint8: 4x smaller
    than float). The default is an uncompressed contiguous layout, the fastest for random
    reads of whole samples; ``compression="gzip"`` or ``"lzf"`` chunks by sample.
    """
    h5py = _h5py()
    target = Path(path)
    with atomic_path(target, suffix=".h5") as tmp:
        with h5py.File(tmp, "w") as f:
            arrays = _arrays(data)
            if arrays is None:
                count, shape, dtype, has_labels = _write_from_dataset(f, data, images_key, labels_key, compression, progress)
            else:
                images, labels = arrays
                images = _as_numpy(images)
                if images.ndim < 2:
                    raise UserError(f"images must be an array of samples (N, ...), got shape {images.shape}")
                kw = _layout_kwargs(images.shape, compression)
                f.create_dataset(images_key, data=images, **kw)
                has_labels = labels is not None
                if has_labels:
                    labels = _as_numpy(labels).astype(np.int64).reshape(-1)
                    if len(labels) != len(images):
                        raise UserError(f"{len(images)} images but {len(labels)} labels")
                    f.create_dataset(labels_key, data=labels)
                count, shape, dtype = len(images), tuple(images.shape[1:]), images.dtype
    return {
        "path": str(target),
        "count": int(count),
        "sample_shape": shape,
        "dtype": str(np.dtype(dtype)),
        "labels": has_labels,
        "bytes": target.stat().st_size,
    }


# --- helpers ---------------------------------------------------------------------------


def _write_from_dataset(
    f: Any, dataset: Any, images_key: str, labels_key: str, compression: str | None, progress: bool
) -> tuple[int, tuple[int, ...], np.dtype, bool]:
    n = len(dataset)
    if n == 0:
        raise UserError("the dataset is empty: nothing to write")
    first = dataset[0]
    has_labels = isinstance(first, (tuple, list))
    image0 = _as_numpy(first[0] if has_labels else first)
    shape, dtype = tuple(image0.shape), image0.dtype
    images = f.create_dataset(images_key, shape=(n, *shape), dtype=dtype, **_layout_kwargs((n, *shape), compression))
    labels = f.create_dataset(labels_key, shape=(n,), dtype=np.int64) if has_labels else None
    indices: Iterable[int] = range(n)
    if progress:
        from tqdm.auto import tqdm

        indices = tqdm(indices, desc="write hdf5", unit="sample")
    for i in indices:
        sample = first if i == 0 else dataset[i]
        image = _as_numpy(sample[0] if has_labels else sample)
        if image.shape != shape:
            raise UserError(
                f"sample {i} has shape {image.shape}, sample 0 has {shape}: HDF5 rows need one shape "
                "(resize first, or use the packed format, which stores any size)"
            )
        images[i] = image
        if labels is not None:
            labels[i] = int(sample[1])
    return n, shape, dtype, has_labels


def _arrays(data: Any) -> tuple[Any, Any] | None:
    """``(images, labels)`` if ``data`` is arrays, ``None`` if it is a dataset."""
    if isinstance(data, (np.ndarray, torch.Tensor)):
        return data, None
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], (np.ndarray, torch.Tensor)):
        return data[0], data[1]
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return None
    raise UserError(
        f"write_hdf5 takes (images, labels) arrays, an images array, or a map-style dataset; got {type(data).__name__}"
    )


def _layout_kwargs(shape: tuple[int, ...], compression: str | None) -> dict[str, Any]:
    if compression is None:
        return {}
    return {"compression": compression, "chunks": (1, *shape[1:])}  # one sample per chunk: random access


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _h5py() -> Any:
    return require("h5py", "data", "HDF5 support")
