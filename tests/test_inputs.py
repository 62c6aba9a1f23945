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


# -- named inputs (keyword arguments of the forward), ones / zeros --------------------------------

@pytest.mark.parametrize("text", ["3x224x224", "int64:128:1000", "int32:4", "float16:3x8", "bool:5", "ones:128",
                                  "zeros:2x3", "input_ids=int64:128:50257", "attention_mask=ones:128",
                                  "token_type_ids=zeros:128", "pixel_values=3x32x32"])
def test_str_of_a_spec_parses_back_to_the_same_spec(text):
    (spec,) = parse_input_specs(text)
    assert str(spec) == text
    assert parse_input_specs(str(spec)) == [spec]


def test_named_specs_give_a_dict_of_the_same_tensors_as_positional_ones():
    specs = parse_input_specs(["input_ids=long:16:50", "attention_mask=ones:16", "token_type_ids=zeros:16"])
    assert [s.name for s in specs] == ["input_ids", "attention_mask", "token_type_ids"]
    named = make_inputs(specs, batch=3, seed=4)
    positional = make_inputs("long:16:50,ones:16,zeros:16", batch=3, seed=4)
    assert isinstance(named, dict) and list(named) == ["input_ids", "attention_mask", "token_type_ids"]
    assert isinstance(positional, tuple)
    assert all(torch.equal(a, b) for a, b in zip(named.values(), positional))
    assert named["attention_mask"].dtype == torch.int64 and bool((named["attention_mask"] == 1).all())
    assert named["token_type_ids"].shape == (3, 16) and int(named["token_type_ids"].abs().sum()) == 0


@pytest.mark.parametrize("bad, needle", [
    (["input_ids=long:8:10", "ones:8"], "name every input"),
    (["long:8:10", "attention_mask=ones:8"], "name every input"),
    (["x=3", "x=4"], "given twice"),
    (["1x=3"], "Python identifier"),
    (["class=3"], "Python identifier"),
    (["=3"], "Python identifier"),
    (["input_ids=long:abc"], "bad input spec 'input_ids=long:abc'"),
    (["input_ids="], "bad input spec"),
    (["mask=ones:8:2"], "ones takes the shape only"),
    (["mask=zeros"], "zeros takes the shape only"),
    (["mask=ones:0"], "positive"),
])
def test_bad_named_specs_raise_one_line(bad, needle):
    with pytest.raises(UserError, match=needle) as err:
        parse_input_specs(bad)
    assert "\n" not in str(err.value)


# -- call_model: a dict is keyword arguments, a tuple positional, anything else one argument ------

class Echo(torch.nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


def test_call_model_dispatches_by_the_form_of_the_inputs():
    from collections import namedtuple

    from torch_tricks.inspect.inputs import call_model, input_tensors, split_inputs

    x, m = torch.ones(2), torch.zeros(2)
    assert call_model(Echo(), {"input_ids": x, "attention_mask": m}) == ((), {"input_ids": x, "attention_mask": m})
    assert call_model(Echo(), (x, m)) == ((x, m), {})
    assert call_model(Echo(), [x, m]) == ((x, m), {})
    assert call_model(Echo(), x) == ((x,), {})
    Pair = namedtuple("Pair", "a b")
    pair = Pair(x, m)
    assert call_model(Echo(), pair) == ((pair,), {})  # a namedtuple is one input
    assert call_model(Echo(), ({"side": x},)) == (({"side": x},), {})  # a dict inside a tuple stays positional
    assert split_inputs({"a": x}) == ((), {"a": x})
    assert input_tensors({"a": x, "b": 3, "c": m}) == [x, m]


def test_as_input_tuple_refuses_a_dict_instead_of_wrapping_it():
    from torch_tricks.inspect.inputs import as_input_tuple

    with pytest.raises(UserError, match="keyword inputs \\(input_ids\\)"):
        as_input_tuple({"input_ids": torch.ones(1)})
    assert as_input_tuple([torch.ones(1)])[0].shape == (1,)


def test_describe_inputs_names_keyword_inputs():
    from torch_tricks.inspect.inputs import describe_inputs

    inputs = make_inputs("input_ids=long:4:9,attention_mask=ones:4", batch=2)
    assert describe_inputs(inputs) == "input_ids=(2, 4) int64, attention_mask=(2, 4) int64"


# -- check_input_names ------------------------------------------------------------------------------

class TwoInputs(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, *, scale=1.0):
        return input_ids


class AnyKwargs(torch.nn.Module):
    def forward(self, x, **kwargs):
        return x


def test_check_input_names_against_the_forward():
    from torch_tricks.inspect.inputs import check_input_names

    check_input_names(TwoInputs(), ["input_ids", "attention_mask", "scale"])
    check_input_names(AnyKwargs(), ["x", "anything", "at_all"])  # **kwargs takes every name
    with pytest.raises(UserError) as err:
        check_input_names(TwoInputs(), ["input_ids", "attention_mak"])
    assert str(err.value) == ("model TwoInputs's forward takes no input named 'attention_mak': did you mean "
                              "'attention_mask'? it takes input_ids, attention_mask, scale")


def test_check_input_names_reads_declared_kwargs():
    from typing import TypedDict, Unpack

    from torch_tricks.inspect.inputs import check_input_names

    class Extra(TypedDict, total=False):
        output_attentions: bool

    class Declared(torch.nn.Module):
        def forward(self, x, **kwargs: Unpack[Extra]):
            return x

    check_input_names(Declared(), ["x", "output_attentions"])
    with pytest.raises(UserError, match="no input named 'foo'"):
        check_input_names(Declared(), ["foo"])


def test_check_input_names_of_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    from torch_tricks.inspect.inputs import check_input_names

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                                                 n_positions=16))
    check_input_names(model, ["input_ids", "attention_mask", "labels", "output_attentions"])
    # its forward has **kwargs, which it passes down and ignores: a misspelt name must not slip through
    with pytest.raises(UserError) as err:
        check_input_names(model, ["input_ids", "foo"])
    message = str(err.value)
    assert message.startswith("model GPT2LMHeadModel's forward takes no input named 'foo': it takes input_ids, ")
    assert "attention_mask" in message and "\n" not in message


# -- a causal LM's positional token input is input_ids; keyword inputs by position (issue 34) ----------

def _gpt2():
    pytest.importorskip("transformers")
    from torch_tricks.models import load_model

    torch.manual_seed(0)
    return load_model("hf:gpt2", hf_config="n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=16")[0]


def test_a_causal_lms_positional_token_input_becomes_input_ids():
    from torch_tricks.inspect.inputs import is_causal_lm, token_input_as_keyword

    model, ids = _gpt2(), torch.randint(0, 64, (2, 8))
    assert is_causal_lm(model) and not is_causal_lm(torch.nn.Linear(2, 2))
    for given in (ids, (ids,), [ids]):
        out = token_input_as_keyword(model, given)
        assert list(out) == ["input_ids"] and out["input_ids"] is ids
    floats = (torch.randn(2, 8),)
    assert token_input_as_keyword(model, floats) is floats  # not token ids
    two = (ids, torch.ones_like(ids))
    assert token_input_as_keyword(model, two) is two  # which is which is the user's to say, by name
    named = {"input_ids": ids}
    assert token_input_as_keyword(model, named) is named
    other = torch.nn.Embedding(64, 4)
    assert token_input_as_keyword(other, (ids,)) == (ids,)  # not a transformers causal LM


def test_example_batch_of_positional_ids_trains_the_lm_on_its_own_loss_as_named_ones_do():
    from torch_tricks.batches import example_batch, labels_go_in
    from torch_tricks.outputs import get_loss

    model, ids = _gpt2(), torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    positional, loss_fn = example_batch(model, (ids,))
    named, _ = example_batch(model, {"input_ids": ids})
    assert set(positional) == {"input_ids", "labels"} and torch.equal(positional["labels"], ids)
    assert labels_go_in(model, positional, loss_fn)  # what chunked_lm_loss needs: the model's loss of its labels
    assert all(torch.equal(positional[k], named[k]) for k in named)
    ce_batch, _ = example_batch(model, (ids,), loss="ce")  # a loss of the user's: the target is outside the model
    assert isinstance(ce_batch, tuple) and not labels_go_in(model, ce_batch, get_loss("ce"))


def test_keyword_inputs_go_by_position_where_they_bind_to_the_first_arguments():
    from torch_tricks.inspect.inputs import keyword_as_positional

    class Two(torch.nn.Module):
        def forward(self, a, b=None, c=None):
            return a if b is None else a + b

    x, y = torch.ones(2), torch.full((2,), 2.0)
    assert keyword_as_positional(Two(), {"b": y, "a": x}, "optimize") == (x, y)  # the forward's order
    assert keyword_as_positional(Two(), {"a": x}, "optimize") == (x,)
    with pytest.raises(UserError, match=r"^optimize calls the model with positional inputs, and Two's forward takes "
                                        r"'b' before 'c', so c cannot go by position: leave it out"):
        keyword_as_positional(Two(), {"a": x, "c": y}, "optimize")
    with pytest.raises(UserError, match="Two's forward has no positional argument 'd'"):
        keyword_as_positional(Two(), {"d": x}, "optimize")
