"""torch_tricks._gc.new_objects_only: collections inside scan only the new objects, and still collect them."""

import gc
import weakref

import pytest

from torch_tricks._gc import new_objects_only

pytestmark = pytest.mark.usefixtures("gc_unfrozen")  # these tests start from no freeze (the suite's lifted)


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # garbage only a collection frees
    return weakref.ref(a)


def test_inside_only_new_objects_are_scanned_and_new_garbage_is_collected():
    old = [_Node()]
    with new_objects_only() as froze:
        assert froze and gc.get_freeze_count() > 0
        assert not any(o is old for o in gc.get_objects())  # the objects from before are frozen out of the scans
        new = [_Node()]
        assert any(o is new for o in gc.get_objects())
        dead = _cycle()
        gc.collect()
        assert dead() is None  # what the block made is collected as always
    assert gc.get_freeze_count() == 0 and any(o is old for o in gc.get_objects())


def test_garbage_from_before_is_collected_first_not_frozen():
    dead = _cycle()
    with new_objects_only():
        assert dead() is None


def test_a_callers_own_freeze_is_kept():
    mine = [_Node()]
    gc.freeze()
    try:
        with new_objects_only() as froze:
            assert not froze
        assert gc.get_freeze_count() > 0 and not any(o is mine for o in gc.get_objects())  # still frozen
    finally:
        gc.unfreeze()


def test_an_error_inside_gives_the_objects_back():
    try:
        with new_objects_only():
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0
