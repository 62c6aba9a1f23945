"""Token files for a causal LM (issue 34): nanoGPT's .bin and 1-D .npy read by memory map, cut into windows of
--seq tokens as transformers-style dicts that fit trains with the model's own loss; every bad form is one line."""

import pickle

import numpy as np
import pytest
import torch

from torch_tricks.data.tokens import TokenDataset, is_token_file, parse_token_ref
from torch_tricks.errors import UserError


def _bin(tmp_path, ids, dtype=np.uint16, name="tokens.bin"):
    path = tmp_path / name
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def test_a_bin_file_is_cut_into_non_overlapping_windows_of_seq_tokens(tmp_path):
    path = _bin(tmp_path, np.arange(100))
    ds = TokenDataset(path, 32)
    assert len(ds) == 3  # 100 // 32: the trailing 4 tokens are left out
    for i in range(3):
        sample = ds[i]
        assert set(sample) == {"input_ids", "labels"}
        assert sample["input_ids"].dtype == torch.int64 and sample["input_ids"].shape == (32,)
        assert torch.equal(sample["input_ids"], torch.arange(32 * i, 32 * (i + 1)))
        assert torch.equal(sample["labels"], sample["input_ids"])  # the model shifts them itself
    assert torch.equal(ds[-1]["input_ids"], ds[2]["input_ids"])
    with pytest.raises(IndexError):
        ds[3]


def test_uint32_bin_and_npy_files_read_their_ids(tmp_path):
    ids = np.arange(70_000, 70_040)  # over uint16's range
    ds = TokenDataset(f"{_bin(tmp_path, ids, np.uint32)}:uint32", 8)
    assert len(ds) == 5 and int(ds[4]["input_ids"][-1]) == 70_039
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    ds = TokenDataset(tmp_path / "ids.npy", 10)
    assert len(ds) == 4 and torch.equal(ds[1]["input_ids"], torch.from_numpy(ids[10:20]))
    assert isinstance(ds.tokens, np.memmap) or ds.tokens.base is not None  # memory-mapped, not read whole


def test_a_pickled_dataset_carries_no_data_and_reopens_the_map(tmp_path):
    ds = TokenDataset(_bin(tmp_path, np.arange(4096)), 16)
    blob = pickle.dumps(ds)
    assert len(blob) < 1024  # not the 8 KiB of tokens (a memmap pickles its whole data)
    assert torch.equal(pickle.loads(blob)[3]["input_ids"], ds[3]["input_ids"])


def test_token_refs_are_told_from_data_set_names(tmp_path):
    assert is_token_file("train.bin") and is_token_file("train.bin:uint32") and is_token_file("a/ids.NPY")
    assert is_token_file("train.bin:int8")  # a token file with a bad dtype: refused by name, below
    assert not is_token_file("digits") and not is_token_file("data.h5")
    path = _bin(tmp_path, [1, 2])
    assert parse_token_ref(f"{path}:uint32") == (path, "uint32") and parse_token_ref(path) == (path, None)


def _bad_files(tmp_path):
    np.save(tmp_path / "two_d.npy", np.zeros((4, 8), dtype=np.int64))
    np.save(tmp_path / "floats.npy", np.zeros(64))
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 65)
    (tmp_path / "junk.npy").write_bytes(b"not an npy file")
    _bin(tmp_path, np.arange(10), name="short.bin")
    _bin(tmp_path, np.arange(64), np.uint32, name="u32.bin")
    np.save(tmp_path / "neg.npy", np.array([1, -3, 2, 4], dtype=np.int32))


@pytest.mark.parametrize("ref,seq,vocab,needle", [
    ("two_d.npy", 4, None, "holds a 2-D array of shape (4, 8): token ids must be 1-D"),
    ("floats.npy", 4, None, "holds float64 values: token ids are integers"),
    ("odd.bin", 4, None, "is 65 bytes, not a whole number of uint16 ids (2 bytes each)"),
    ("junk.npy", 4, None, "does not load as .npy"),
    ("short.bin", 32, None, "holds 10 tokens, fewer than one sequence of --seq 32"),
    ("u32.bin:int8", 4, None, "unknown token dtype 'int8'"),
    ("u32.bin:uint32", 4, 50, "holds the id 63, but the model's vocabulary has 50 ids"),
    ("neg.npy", 2, 50, "holds the negative id -3"),
    ("u32.bin", 0, None, "--seq must be >= 1"),
    ("missing.bin", 4, None, "not found"),
    ("two_d.npy:uint16", 4, None, "an .npy file carries its own dtype"),
    ("tokens.txt", 4, None, "is not a token file"),
])
def test_a_token_file_of_the_wrong_form_is_one_line(tmp_path, ref, seq, vocab, needle):
    _bad_files(tmp_path)
    with pytest.raises(UserError) as err:
        TokenDataset(tmp_path / ref if ":" not in ref else f"{tmp_path / ref}", seq, vocab_size=vocab)
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def test_fit_trains_a_causal_lm_on_it_with_the_models_own_loss(tmp_path):
    pytest.importorskip("transformers")
    from torch_tricks.models import load_model
    from torch_tricks.train import fit

    cfg = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64, "resid_pdrop": 0.0,
           "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    ids = np.random.default_rng(0).integers(0, 256, 4 * 32 + 5)
    ds = TokenDataset(_bin(tmp_path, ids), 32, vocab_size=256)
    torch.manual_seed(0)
    model = load_model("hf:gpt2", hf_config=cfg)[0]
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids[:128].reshape(4, 32)).long(),
                         labels=torch.from_numpy(ids[:128].reshape(4, 32)).long()).loss  # every sample, one batch
    h = fit(model, ds, epochs=1, batch_size=4, progress=False, device="cpu", log_every=1)
    assert h.steps == 1  # the 4 windows in one (shuffled) batch; its loss is taken before the update
    assert h.final["train_loss"] == pytest.approx(float(expected), rel=1e-5)
