"""`kvpot.engine.heap`: objects alive at `freeze` are out of the collector's reach until `thaw`; later ones are not."""

import gc
import weakref

import pytest

from kvpot.engine import heap


class Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_cycle_alive_at_freeze_waits_for_thaw_and_a_later_one_does_not():
    before = Node()
    frozen = heap.freeze()
    assert frozen == gc.get_freeze_count() > 0
    after = Node()
    early, late = weakref.ref(before), weakref.ref(after)
    del before, after
    gc.collect()
    assert late() is None  # made after the freeze: collected as usual
    assert early() is not None  # frozen: a full pass does not see it
    heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert early() is None


def test_freeze_collects_first():
    garbage = Node()
    dead = weakref.ref(garbage)
    del garbage
    heap.freeze()  # collected before freezing, not kept forever
    assert dead() is None
