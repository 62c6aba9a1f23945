"""The deploy-step protocol: a step registered once, next to its code, is a step and a trick.

The example step below is defined in this file only: registering it with
:func:`deploy_step` is all it takes for ``optimize`` to plan, apply and verify it, for
``list_steps()`` to list it and for the trick registry to hold it (nothing else changes).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn

from torch_tricks.deploy import pipeline
from torch_tricks.deploy.pipeline import list_steps, optimize
from torch_tricks.deploy.steps import EXACT, StepContext, StepResult, deploy_step, get_step, registered_steps, \
    unregister_step
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick, list_tricks

_NAME = "float64-round-trip"


def _float64_round_trip(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """Cast the weights to float64 and back: the same model by another route (a step that changes nothing)."""
    new = copy.deepcopy(model).double().float()
    return new, ctx.result(backend="float64 and back", changed=False, notes=[f"argument {ctx.arg or '-'}"])


@pytest.fixture
def example_step():
    """The example step, registered for one test and removed after it (step table and trick registry)."""
    deploy_step(
        _NAME,
        summary="cast the weights to float64 and back (an example step: same outputs)",
        tolerance=EXACT,
        aliases=("f64",),
        trades="nothing: an example of the deploy-step protocol",
    )(_float64_round_trip)
    yield get_step(_NAME)
    unregister_step(_NAME)  # the step, its alias and its trick
    assert _NAME not in list_steps() and _NAME not in {t.name for t in list_tricks()}


def test_a_step_registered_in_a_test_file_plans_applies_and_verifies(example_step):
    model = get_model("small_cnn").eval()
    x = torch.randn(4, 1, 8, 8)
    res = optimize(model, f"fuse,{_NAME}", x, measure=False)
    step = res.steps[-1]
    assert step.name == _NAME and step.step == _NAME and step.backend == "float64 and back"
    assert step.within_tolerance is True and step.tolerance == EXACT.describe() and res.ok
    assert step.notes == ["argument -"] and not step.changed
    assert step.status == "no change"  # within its tolerance, but a step that changed nothing is not "ok"
    with torch.inference_mode():
        assert torch.allclose(res.model(x), model(x), atol=1e-5)
    # its alias plans the same step; it takes no argument, like any step declared without args
    assert optimize(model, "F64", x, measure=False).steps[0].name == _NAME
    with pytest.raises(UserError, match=f"step '{_NAME}' takes no argument"):
        optimize(model, f"{_NAME}:3", x, measure=False)


def test_the_example_step_is_listed_as_a_step_and_as_a_trick(example_step):
    assert list(list_steps())[-1] == _NAME and "float64" in list_steps()[_NAME]
    trick = get_trick(_NAME)
    assert trick.kind == "deploy" and trick.fn is _float64_round_trip
    assert trick.switch_on == f"torch-tricks optimize --steps {_NAME}"
    assert example_step.apply is _float64_round_trip and not example_step.final
    # nothing else had to know about it: the planner only asks the step table
    assert _NAME not in inspect.getsource(pipeline)


def test_a_step_name_is_registered_once(example_step):
    with pytest.raises(ValueError, match="registered twice"):
        deploy_step("f64", summary="x")(_float64_round_trip)
    with pytest.raises(ValueError, match="registered twice"):
        deploy_step("fuse", summary="x")(_float64_round_trip)


# The trick names came first (tune reports, docs anchors, user code): each is an alias of its step and trick.
_OLD_NAMES = {
    "fuse_conv_bn": "fuse",
    "reparameterize": "reparam",
    "prune_channels": "prune",
    "int8_static": "int8",
    "int8_dynamic": "int8-dynamic",
    "half_precision_inference": "bf16",
    "onnx_export": "onnx",
}


@pytest.mark.parametrize("old, name", sorted(_OLD_NAMES.items()))
def test_older_trick_names_are_aliases_of_the_step(old, name):
    step = get_step(old)
    assert step.name == name and step.trick == name and old in step.aliases
    assert get_trick(old) is get_trick(name) and get_trick(name).kind == "deploy" and get_trick(name).ids == step.ids


def test_every_step_is_a_trick_and_the_chain_takes_an_alias():
    tricks = {t.name: t for t in list_tricks("deploy")}
    for step in registered_steps():  # one name for both
        assert step.trick == step.name and step.name in tricks, step.name
    model = get_model("small_cnn").eval()
    res = optimize(model, "fuse_conv_bn, prune_channels:0.25", torch.randn(4, 1, 8, 8), measure=False)
    assert [s.name for s in res.steps] == ["fuse", "prune"]
    assert [s.step for s in res.steps] == ["fuse_conv_bn", "prune_channels:0.25"]


def test_unknown_step_lists_the_step_names():
    with pytest.raises(UserError, match="unknown step 'nope': choose from fuse, reparam, prune, int8"):
        optimize(get_model("small_cnn"), "nope", torch.randn(2, 1, 8, 8), measure=False)
