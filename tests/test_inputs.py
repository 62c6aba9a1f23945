import pytest
import torch

from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import InputSpec, make_inputs, parse_input_specs


def test_parse_float_shape():
    (spec,) = parse_input_specs("3x224x224")
    assert spec == InputSpec((3, 224, 224), torch.float32, None)
    assert str(spec) == "3x224x224"


def test_parse_tokens_and_several_inputs():
    specs = parse_input_specs(["long:128:1000", "3x8,int32:4"])
    assert [s.shape for s in specs] == [(128,), (3, 8), (4,)]
    assert specs[0].dtype == torch.int64 and specs[0].high == 1000
    assert specs[2].dtype == torch.int32 and specs[2].high is None
    assert str(specs[0]) == "int64:128:1000"


@pytest.mark.parametrize("bad", ["", "abc", "3x", "3x0x2", "float:3:10", "long:3:x", "long:3:5:6", "x3"])
def test_bad_specs_raise_one_line(bad):
    with pytest.raises(UserError) as err:
        parse_input_specs(bad)
    assert "\n" not in str(err.value)


def test_make_inputs_batch_dtype_bounds_and_seed():
    a = make_inputs("3x4x4,long:16:7", batch=5, seed=1)
    b = make_inputs("3x4x4,long:16:7", batch=5, seed=1)
    assert a[0].shape == (5, 3, 4, 4) and a[0].dtype == torch.float32
    assert a[1].shape == (5, 16) and a[1].dtype == torch.int64
    assert int(a[1].min()) >= 0 and int(a[1].max()) < 7
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_token_bound_defaults_to_model_vocab():
    model = torch.nn.Embedding(11, 4)
    model.vocab_size = 11
    (x,) = make_inputs("long:4096", batch=1, model=model)
    assert int(x.max()) == 10


def test_batch_must_be_positive():
    with pytest.raises(UserError):
        make_inputs("3", batch=0)
