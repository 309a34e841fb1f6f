"""The gateway's hint of which images it has sent to an encoder before."""

import pytest

from gateway.seen_images import SeenImages


def test_keys_are_remembered_until_evicted_least_recently_seen_first():
    seen = SeenImages(capacity=2)
    seen.add(["a", "b"])
    assert seen.seen("a") and seen.seen("b") and not seen.seen("c")
    seen.add(["a"])          # refresh a: b is now the oldest
    seen.add(["c"])
    assert seen.seen("a") and seen.seen("c") and not seen.seen("b")
    assert len(seen) == 2


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        SeenImages(capacity=0)
