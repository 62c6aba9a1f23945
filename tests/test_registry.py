"""The trick registry: one entry per trick, earlier names as aliases, a registration that can be undone."""

from __future__ import annotations

import pytest

from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick, list_tricks, register_trick, trick_name, unregister_trick


def _example(model):
    return model


def test_an_alias_finds_the_trick_and_is_not_listed_twice():
    register_trick("example_trick", ids=("T1",), kind="train", trades="nothing",
                   aliases=("old_example_name",))(_example)
    try:
        assert get_trick("old_example_name") is get_trick("example_trick")
        assert get_trick("example_trick").aliases == ("old_example_name",)
        assert trick_name("old_example_name") == "example_trick" == trick_name("example_trick")  # what --skip reads
        names = [t.name for t in list_tricks()]
        assert names.count("example_trick") == 1 and "old_example_name" not in names
        with pytest.raises(ValueError, match="registered twice"):
            register_trick("old_example_name", ids=(), kind="train", trades="x")(_example)
        with pytest.raises(ValueError, match="registered twice"):
            register_trick("other", ids=(), kind="train", trades="x", aliases=("example_trick",))(_example)
    finally:
        unregister_trick("example_trick")
    for name in ("example_trick", "old_example_name"):
        with pytest.raises(UserError, match="unknown trick"):
            get_trick(name)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        register_trick("x", ids=(), kind="magic", trades="x")
