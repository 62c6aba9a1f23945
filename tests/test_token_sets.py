"""Token sets for fine-tuning (issue 38): rows of different lengths from a saved data set, JSONL or Parquet, as
input_ids or as text a local tokenizer reads; every row counted (kept, empty, cut), every bad form one line, and
`train --data` taking them."""

import json
import pickle
import sys

import numpy as np
import pytest
import torch

from torch_tricks.cli import main
from torch_tricks.data.token_sets import TokenRows, is_token_set, load_token_rows
from torch_tricks.errors import UserError

ROWS = [[5, 6, 7], [1], [9, 8, 7, 6, 5, 4], [2, 3]]


def _jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def _parquet(path, columns):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _saved(path, columns, splits=None):
    datasets = pytest.importorskip("datasets")
    if splits is None:
        datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    else:
        datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()}).save_to_disk(str(path))
    return path


def _rows(data):
    return [data[i]["input_ids"].tolist() for i in range(len(data))]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer folder, built offline from two sentences (transformers' save_pretrained form)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran far"],
                            tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


# -- the readers --------------------------------------------------------------------------------------

def test_jsonl_rows_keep_their_lengths_ids_and_order(tmp_path):
    data = load_token_rows(_jsonl(tmp_path / "rows.jsonl", [{"input_ids": r, "id": i} for i, r in enumerate(ROWS)]))
    assert isinstance(data, TokenRows) and len(data) == 4 and data.lengths == [3, 1, 6, 2]
    assert _rows(data) == ROWS
    assert data[0]["input_ids"].dtype == torch.long and set(data[0]) == {"input_ids"}
    assert data[-1]["input_ids"].tolist() == [2, 3]
    with pytest.raises(IndexError):
        data[4]
    assert data.ids.dtype == np.int32 and data.offsets.tolist() == [0, 3, 4, 10, 12]  # one flat array, not tensors
    assert _rows(pickle.loads(pickle.dumps(data))) == ROWS  # a DataLoader worker gets the same rows
    s = data.stats
    assert (s.read, s.kept, s.empty, s.truncated, s.tokens, s.longest) == (4, 4, 0, 0, 12, 6)
    assert data.summary() == "rows.jsonl (JSONL, input_ids): 4 rows read, 4 kept, 12 tokens, the longest 6"


def test_parquet_and_saved_data_sets_read_the_same_rows(tmp_path):
    parquet = load_token_rows(_parquet(tmp_path / "rows.parquet", {"input_ids": ROWS, "n": [1, 2, 3, 4]}))
    saved = load_token_rows(_saved(tmp_path / "saved", {"input_ids": ROWS}))
    assert _rows(parquet) == _rows(saved) == ROWS
    assert parquet.summary().startswith("rows.parquet (Parquet, input_ids): 4 rows read")
    assert saved.summary().startswith("saved (saved data set, input_ids): 4 rows read")


def test_a_dataset_dict_gives_the_split_asked_for(tmp_path):
    path = _saved(tmp_path / "dd", None, {"train": {"input_ids": ROWS}, "test": {"input_ids": [[4, 4]]}})
    assert _rows(load_token_rows(path)) == ROWS  # train by default
    assert _rows(load_token_rows(f"{path}:test")) == [[4, 4]] == _rows(load_token_rows(path, split="test"))
    assert load_token_rows(f"{path}:test").summary().startswith("dd (saved data set, split test, input_ids)")
    assert is_token_set(f"{path}:test") and is_token_set(path) and is_token_set(tmp_path / "x.jsonl")
    assert not is_token_set("digits") and not is_token_set(tmp_path / "x.bin")
    with pytest.raises(UserError, match=r"dd has no split 'validation' \(its splits: train, test\): give .*dd:SPLIT"):
        load_token_rows(f"{path}:validation")


def test_text_is_tokenized_with_a_local_tokenizer_folder_and_input_ids_win_over_it(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    texts = ["the cat sat", "", None, "a dog ran on the mat"]
    want = [AutoTokenizer.from_pretrained(str(tokenizer))(t)["input_ids"] for t in ("the cat sat", "a dog ran on the mat")]
    for path in (_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]),
                 _parquet(tmp_path / "t.parquet", {"text": texts}), _saved(tmp_path / "t", {"text": texts})):
        data = load_token_rows(path, tokenizer=tokenizer, vocab_size=20)
        assert _rows(data) == want and (data.stats.read, data.stats.empty) == (4, 2), path
        assert f"text tokenized by {tokenizer.name})" in data.summary()
    both = load_token_rows(_jsonl(tmp_path / "both.jsonl", [{"text": "the cat", "input_ids": [7]}]),
                           tokenizer=tokenizer)
    assert _rows(both) == [[7]]


def test_empty_rows_are_left_out_and_long_rows_cut_with_truncate_all_counted(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [{"input_ids": r} for r in ([1, 2, 3, 4, 5, 6], [], [7], None, [8] * 9)])
    data = load_token_rows(path, max_positions=4, truncate=True)
    assert _rows(data) == [[1, 2, 3, 4], [7], [8] * 4]
    s = data.stats
    assert (s.read, s.kept, s.empty, s.truncated, s.tokens, s.longest, s.cut_to) == (5, 3, 2, 2, 9, 4, 4)
    assert data.summary() == ("r.jsonl (JSONL, input_ids): 5 rows read, 3 kept, 9 tokens, the longest 4; "
                              "2 empty rows left out; 2 rows cut to 4 tokens")
    with pytest.raises(UserError) as err:
        load_token_rows(path, max_positions=4)
    assert str(err.value) == ("r.jsonl has 2 rows longer than the model's 4 positions (the longest 9 tokens): give "
                              "--truncate to cut them to 4 tokens, or a model with more positions")


# -- every bad form, one line -------------------------------------------------------------------------

def _bad(tmp_path):
    _jsonl(tmp_path / "big.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 50]}])
    _jsonl(tmp_path / "neg.jsonl", [{"input_ids": [1, -2]}])
    _jsonl(tmp_path / "floats.jsonl", [{"input_ids": [1, 2.5]}])
    _jsonl(tmp_path / "words.jsonl", [{"input_ids": "1 2 3"}])
    _jsonl(tmp_path / "cols.jsonl", [{"label": 1, "prompt": "hi"}])
    _jsonl(tmp_path / "text.jsonl", [{"text": "hi"}])
    _jsonl(tmp_path / "empty.jsonl", [{"input_ids": []}])
    _jsonl(tmp_path / "uneven.jsonl", [{"input_ids": [1]}, {"text": "hi"}])
    (tmp_path / "junk.jsonl").write_text('{"input_ids": [1]}\nnot json\n')
    (tmp_path / "rows.csv").write_text("input_ids\n1 2\n")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    (tmp_path / "folder").mkdir()
    _parquet(tmp_path / "floats.parquet", {"input_ids": [[1.0, 2.0]]})
    _parquet(tmp_path / "cols.parquet", {"a": [1], "b": ["x"]})
    _saved(tmp_path / "saved", {"label": [1, 2]})


@pytest.mark.parametrize("ref,kw,needle", [
    ("big.jsonl", {"vocab_size": 50}, "line 2 of big.jsonl holds the id 50, but the model's vocabulary has 50 ids"),
    ("neg.jsonl", {}, "line 1 of neg.jsonl holds the negative id -2: token ids are 0 or more"),
    ("floats.jsonl", {}, "line 1 of floats.jsonl: input_ids holds 2.5, not an integer token id"),
    ("words.jsonl", {}, "line 1 of words.jsonl: input_ids is a JSON string, not a list of token ids"),
    ("floats.parquet", {}, "the input_ids column of floats.parquet holds list<element: double>, not lists of integer"),
    ("cols.jsonl", {}, "cols.jsonl has no input_ids or text column (its columns: label, prompt)"),
    ("cols.parquet", {}, "cols.parquet has no input_ids or text column (its columns: a, b)"),
    ("saved", {}, "saved has no input_ids or text column (its columns: label)"),
    ("text.jsonl", {}, "text.jsonl holds text, not token ids: give --tokenizer PATH, a local tokenizer folder"),
    ("text.jsonl", {"tokenizer": "no_such_dir"}, "tokenizer folder 'no_such_dir' not found"),
    ("empty.jsonl", {}, "empty.jsonl holds no token rows (1 row read, 1 of them empty)"),
    ("uneven.jsonl", {}, "line 2 of uneven.jsonl has no input_ids (the first line has it)"),
    ("junk.jsonl", {}, "line 2 of junk.jsonl is not JSON (Expecting value): give one JSON object a line"),
    ("rows.csv", {}, "rows.csv is not a token set this reads: give a data set saved with datasets' save_to_disk"),
    ("junk.parquet", {}, "junk.parquet does not read as Parquet"),
    ("folder", {}, "is not a data set saved with save_to_disk (no state.json or dataset_dict.json in it)"),
    ("saved:test", {}, "saved is one data set, not a DatasetDict of splits: give"),
    ("missing.jsonl", {}, "token set 'missing.jsonl' not found"),
])
def test_a_token_set_of_the_wrong_form_is_one_line(tmp_path, monkeypatch, ref, kw, needle):
    _bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        load_token_rows(ref, **kw)
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("module,ref,purpose", [
    ("datasets", "saved", "a saved data set needs datasets"),
    ("pyarrow.parquet", "rows.parquet", "Parquet token data needs pyarrow"),
])
def test_a_missing_optional_library_is_one_line_naming_the_extra(tmp_path, monkeypatch, module, ref, purpose):
    _saved(tmp_path / "saved", {"input_ids": ROWS})
    _parquet(tmp_path / "rows.parquet", {"input_ids": ROWS})
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(UserError) as err:
        load_token_rows(tmp_path / ref)
    assert str(err.value) == f'{purpose}: pip install "torch-tricks[text]"'


# -- torch-tricks train --data SET ----------------------------------------------------------------------

GPT2 = ["--model", "hf:gpt2", "--hf-config", "n_layer=1,n_embd=32,n_head=2,vocab_size=100,n_positions=16"]


def _error_line(capsys, tmp_path, *argv):
    """A train that must fail on bad input: exit 2, nothing on stdout, one error line, no file written."""
    out_file = tmp_path / "history.json"
    code = main(["train", *argv, "--max-steps", "1", "--no-progress", "--out", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not out_file.exists(), err
    lines = [line for line in err.splitlines() if line.startswith("torch-tricks: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _cli_files(tmp_path):
    np.save(tmp_path / "floats.npy", np.zeros(64, dtype=np.float32))
    np.save(tmp_path / "flags.npy", np.ones(64, dtype=bool))
    _jsonl(tmp_path / "cols.jsonl", [{"prompt": "hi", "answer": "yo"}])
    _jsonl(tmp_path / "text.jsonl", [{"text": "hi"}])
    _jsonl(tmp_path / "long.jsonl", [{"input_ids": [1] * n} for n in (3, 20, 17, 16)])
    _jsonl(tmp_path / "rows.jsonl", [{"input_ids": r} for r in ROWS])
    np.arange(64, dtype=np.uint16).tofile(tmp_path / "tokens.bin")


@pytest.mark.parametrize("extra,needle", [
    (["--data", "floats.npy"], "token file floats.npy holds float32 values: token ids are integers (uint16, uint32"),
    (["--data", "flags.npy"], "token file flags.npy holds bool values: token ids are integers"),
    (["--data", "cols.jsonl"], "cols.jsonl has no input_ids or text column (its columns: prompt, answer)"),
    (["--data", "text.jsonl"], "text.jsonl holds text, not token ids: give --tokenizer PATH, a local tokenizer folder"),
    (["--data", "long.jsonl"], "long.jsonl has 2 rows longer than the model's 16 positions (the longest 20 tokens): "
                               "give --truncate to cut them to 16 tokens, or a model with more positions"),
    (["--data", "rows.jsonl", "--seq", "8"], "the rows of rows.jsonl keep their own lengths"),
    (["--data", "tokens.bin", "--truncate"], "--truncate is for a token set (--data FOLDER, FILE.jsonl or FILE.parquet)"),
    (["--data", "rows.jsonl", "--model", "small_cnn"], "--data rows.jsonl is token data, for a transformers causal LM"),
    (["--data", "nope"], "or a token set of rows: a data set saved with save_to_disk (a folder), FILE.jsonl"),
])
def test_train_on_a_bad_token_set_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, extra, needle):
    pytest.importorskip("transformers")
    _cli_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    line = _error_line(capsys, tmp_path, *(extra if "--model" in extra else GPT2 + extra))
    assert needle in line, line


def test_train_on_a_token_set_says_what_it_read(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    _cli_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(["train", *GPT2, "--data", "long.jsonl", "--truncate", "--max-steps", "1", "--batch-size", "4",
                 "--no-progress", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert ("data: long.jsonl (JSONL, input_ids): 4 rows read, 4 kept, 51 tokens, the longest 16; 2 rows cut to 16 "
            "tokens") in err
    assert json.loads(out)["steps"] == 1  # stdout holds only the history


def test_loader_tune_reads_a_token_set_and_says_the_rows_come_from_memory(tmp_path, capsys):
    _jsonl(tmp_path / "rows.jsonl", [{"input_ids": list(range(1, n + 1))} for n in (3, 9, 4, 12, 7, 2, 5, 8)])
    code = main(["loader-tune", str(tmp_path / "rows.jsonl"), "--batch", "4", "--workers", "0", "--seconds", "0.2",
                 "--no-progress", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "in-memory" and out["num_samples"] == 8
    assert any("token_batches" in a for a in out["advice"])
    code = main(["loader-tune", str(tmp_path), "--tokenizer", str(tmp_path), "--no-progress"])
    assert code == 2 and "--tokenizer is for a token set" in capsys.readouterr().err
