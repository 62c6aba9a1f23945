"""tricks.toml's [model] table (issue 34): what the tune ran on, written after [train], read back checked, and
left alone by load_config."""

import tomllib

import pytest

from torch_tricks.errors import UserError
from torch_tricks.train import load_config
from torch_tricks.tuning.record import NOT_RECORDED, model_record, model_table, read_model_record
from torch_tricks.tuning.report import Result, TuneReport

GPT2 = "n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=64"


def _report(record=None) -> TuneReport:
    """A report put together from given figures (nothing timed): the plain step only."""
    report = TuneReport(model="hf:gpt2", batch=4, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="given", budget_s=10.0, model_record=record,
                        baseline=Result("plain", "baseline", {}, (), status="measured", verdict="baseline",
                                        step_s=1.0, ratio=1.0, peak_bytes=1 << 20, losses=[2.0]))
    return report


def test_the_record_keeps_what_was_given_and_leaves_out_the_defaults():
    rec = model_record("hf:gpt2", hf_config=GPT2, inputs="input_ids=long:32:256", batch=4, loss="auto", device="cpu")
    assert rec == {"spec": "hf:gpt2", "hf_config": GPT2, "input": ["input_ids=long:32:256"], "batch": 4,
                   "device": "cpu"}  # loss auto is the default: not recorded
    assert model_record("small_cnn", loss="ce") == {"spec": "small_cnn", "loss": "ce"}


def test_tricks_toml_has_the_model_table_after_train_and_load_config_reads_train_alone(tmp_path):
    rec = model_record("hf:gpt2", hf_config=GPT2, inputs=["input_ids=long:32:256", "attention_mask=ones:32"],
                       batch=4, loss="ce", device="cpu")
    report = _report(rec)
    text = report.tricks_toml()
    assert text.index("[train]") < text.index("[model]")
    data = tomllib.loads(text)
    assert data["model"] == rec
    path = tmp_path / "tricks.toml"
    path.write_text(text)
    assert load_config(path) == data["train"]  # the [model] table does not reach the training config
    assert read_model_record(path) == rec
    assert report.to_dict()["model_record"] == rec


def test_strings_that_need_escaping_round_trip(tmp_path):
    rec = model_record('my "pkg".nets:build\\x', inputs=["3x8x8"], device="cpu")
    path = tmp_path / "tricks.toml"
    path.write_text("[train]\nlr = 0.1\n" + "\n".join(model_table(rec)) + "\n")
    assert read_model_record(path) == rec


def test_a_tune_of_a_model_object_records_none_and_says_so(tmp_path):
    text = _report(None).tricks_toml()
    assert "[model]\n" not in text and "model" not in tomllib.loads(text)
    assert any(line.startswith(NOT_RECORDED) and "--model" in line for line in text.splitlines())
    path = tmp_path / "tricks.toml"
    path.write_text(text)
    assert read_model_record(path) == {}  # a model was tuned, the file cannot say which
    plain = tmp_path / "plain.toml"
    plain.write_text("[train]\nlr = 0.1\n")
    assert read_model_record(plain) is None  # a config of the user's own: no model in it


@pytest.mark.parametrize("table,needle", [
    ('[model]\nspec = "hf:gpt2"\nhf-config = "n_layer=2"\n', "[model] has no key 'hf-config': it takes spec, "),
    ('[model]\nspec = "hf:gpt2"\nbatch = 0\n', "[model] batch = 0 must be a positive integer"),
    ('[model]\nspec = "hf:gpt2"\ninput = "long:32"\n', "[model] input = 'long:32' must be a list of input specs"),
    ('[model]\nspec = 3\n', "[model] spec = 3 must be a string"),
    ('[model]\nhf_config = "n_layer=2"\n', "[model] has no spec"),
    ('model = "hf:gpt2"\n', "[model] must be a table"),
])
def test_a_bad_model_table_is_one_line(tmp_path, table, needle):
    path = tmp_path / "tricks.toml"
    path.write_text(("[train]\nlr = 0.1\n" if table.startswith("[") else "") + table)
    with pytest.raises(UserError) as err:
        read_model_record(path)
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def test_a_config_file_that_is_missing_or_does_not_parse_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"config file '.*missing.toml' not found$"):
        read_model_record(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nspec = 1\n")
    with pytest.raises(UserError) as err:
        read_model_record(bad)
    assert "does not parse" in str(err.value) and "\n" not in str(err.value)
