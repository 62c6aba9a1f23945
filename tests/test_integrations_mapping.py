"""The one table of where each [train] key goes (issue 22, item 4): every key of TrainConfig has a place in every
target, a value without one is one line, and the docs' table is made from it."""

from __future__ import annotations

from dataclasses import fields

import pytest

from torch_tricks.errors import UserError
from torch_tricks.integrations.mapping import TARGETS, Route, place_table, places, routes
from torch_tricks.train import TrainConfig

KEYS = [f.name for f in fields(TrainConfig)]
BUILT = ("fit", "hf", "lightning", "accelerate")


@pytest.mark.parametrize("target", [
    *BUILT,
    *(pytest.param(t, marks=pytest.mark.xfail(strict=True, raises=UserError, reason="issue 22: not built yet"))
      for t in TARGETS if t not in BUILT),
])
def test_every_key_has_a_place_in_every_target(target):
    table = places(target)
    assert sorted(table) == sorted(KEYS), set(KEYS) ^ set(table)  # a new key without a place fails here
    for key, place in table.items():
        assert place.doc, key
    got = routes(TrainConfig(), target)
    assert set(got) == set(KEYS) and all(isinstance(r, Route) and r.how in ("arg", "callback", "code")
                                         for r in got.values())


def test_the_fit_target_is_the_config_itself():
    cfg = TrainConfig(precision="bf16", accumulate=4)
    got = routes(cfg, "fit")
    assert {k: v for r in got.values() for k, v in r.kwargs.items()} == cfg.to_dict()


def test_the_docs_table_is_made_from_the_places():
    rows = place_table()
    assert [r["key"] for r in rows] == KEYS
    assert all(r["hf"] == places("hf")[r["key"]].doc for r in rows)


def test_an_unknown_target_is_one_line():
    with pytest.raises(UserError, match="unknown target 'keras': use one of fit, hf, lightning, accelerate"):
        places("keras")


def test_threads_is_the_callbacks_or_tricks_in_every_trainer():
    """No trainer has an argument for the intra-op threads (issue 35): its callback (Accelerate: the Tricks of
    tricks_for) sets them; no keyword of a trainer carries them, and a configuration without them routes nothing."""
    cfg = TrainConfig(threads=2)
    assert cfg.given == {"threads"}
    for target in ("hf", "lightning", "accelerate"):
        route = routes(cfg, target, given=True)
        assert list(route) == ["threads"] and route["threads"].how == "callback" and not route["threads"].kwargs
        assert "torch.set_num_threads" in places(target)["threads"].doc
        assert "threads" not in routes(TrainConfig(precision="bf16"), target, given=True)
    assert routes(cfg, "fit")["threads"].kwargs == {"threads": 2}
