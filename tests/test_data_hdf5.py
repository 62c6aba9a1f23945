"""HDF5Dataset (D9): lazy per-process handles, safe with DataLoader workers."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

h5py = pytest.importorskip("h5py", reason="HDF5 support needs h5py (pip install 'torch-tricks[data]')")

from torch_tricks.data.hdf5 import HDF5Dataset, write_hdf5  # noqa: E402
from torch_tricks.data.loader import make_loader  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402

N = 40


def _open_files() -> int:
    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


@pytest.fixture
def h5file(tmp_path):
    images = np.stack([np.full((6, 5, 3), i, dtype=np.uint8) for i in range(N)])  # each image encodes its index
    labels = np.arange(N) * 10
    info = write_hdf5((images, labels), tmp_path / "data.h5")
    assert info["count"] == N and info["sample_shape"] == (6, 5, 3) and info["dtype"] == "uint8"
    return tmp_path / "data.h5"


def test_no_handle_in_init_nor_after_pickling(h5file):
    before = _open_files()
    ds = HDF5Dataset(h5file)
    assert ds._file is None and _open_files() == before  # the length was read with a handle since closed
    assert len(ds) == N
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._file is None and len(clone) == N
    image, label = ds[7]
    assert ds._file is not None and _open_files() == before + 1  # opened on first use
    assert image.dtype == torch.uint8 and image.shape == (6, 5, 3) and int(image[0, 0, 0]) == 7 and label == 70
    clone = pickle.loads(pickle.dumps(ds))  # an open handle is not pickled
    assert clone._file is None and int(clone[3][0][0, 0, 0]) == 3
    clone.close()
    ds.close()
    assert ds._file is None and _open_files() == before


def test_reopens_in_a_new_process(h5file):
    ds = HDF5Dataset(h5file)
    ds[0]
    first = ds._file
    ds._pid = -1  # what a forked worker sees: the handle belongs to another process
    ds[1]
    assert ds._file is not first and ds._inherited == [first]  # left for its owner, not closed here
    for f in (ds._file, first):
        f.close()


def test_two_workers_return_every_sample_exactly_once(h5file):
    ds = HDF5Dataset(h5file)
    ds[0]  # the hard case: the main process has a handle open when the workers fork
    loader = make_loader(ds, 8, num_workers=2, seed=0, drop_last=False, device="cpu")
    labels = []
    for images, y in loader:
        assert torch.equal(images[:, 0, 0, 0].long() * 10, y)  # image and label stay paired
        labels.extend(y.tolist())
    assert sorted(labels) == [i * 10 for i in range(N)]
    ds.close()


def test_transform_and_images_only(h5file):
    ds = HDF5Dataset(h5file, labels_key=None, transform=lambda im: im.float() / 255)
    x = ds[2]
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
    assert ds.files() == [str(h5file)]
    with pytest.raises(IndexError):
        ds[N]


def test_write_from_a_dataset(tmp_path):
    ds = TensorDataset(torch.randint(0, 255, (10, 4, 4, 3), dtype=torch.uint8), torch.arange(10))
    write_hdf5(ds, tmp_path / "d.h5")
    back = HDF5Dataset(tmp_path / "d.h5")
    for i in (0, 9):
        assert torch.equal(back[i][0], ds[i][0]) and back[i][1] == i
    back.close()


def test_write_is_atomic_and_checks_shapes(tmp_path):
    class Ragged(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.zeros((4 + i, 4), dtype=np.uint8), i

    with pytest.raises(UserError, match="one shape"):
        write_hdf5(Ragged(), tmp_path / "r.h5")
    assert list(tmp_path.iterdir()) == []  # no partial file, no temporary left behind


def test_bad_inputs(tmp_path, h5file):
    with pytest.raises(UserError, match="no HDF5 file"):
        HDF5Dataset(tmp_path / "missing.h5")
    with pytest.raises(UserError, match="no dataset 'pixels'"):
        HDF5Dataset(h5file, images_key="pixels")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(UserError, match="cannot read"):
        HDF5Dataset(tmp_path / "junk.h5")
    with pytest.raises(UserError, match="labels"):
        write_hdf5((np.zeros((3, 2)), np.zeros(4)), tmp_path / "x.h5")
    assert not os.path.exists(tmp_path / "x.h5")
