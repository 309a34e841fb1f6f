"""Which colocated requests' images go to their decode worker as bytes (``EncoderStep.encode_on_decode``).

Encodes sent to a decode worker run one after another on its model thread, between its steps: a
burst of them is one gap for every sequence running there. So the rule is the stall budget
``colocated_encode_max_ms`` for the encodes still ahead on that worker plus the new one, each
estimated by the cost model. The clock is faked; the end-to-end path (the bytes, the encode on
decode, the store) is ``tests/test_colocated_encode.py``.
"""

from __future__ import annotations

import pytest

from gateway import encoder_step
from gateway.encoder_step import EncoderStep, ImagePlan
from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.cost_model import CostModel


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(encoder_step.time, "monotonic", clock)
    return clock


def new_images(n: int = 1, cached: int = 0) -> ImagePlan:
    keys = [f"key-{i}" for i in range(n)]
    return ImagePlan(keys, [pb.ImageRef(cache_key=k) for k in keys], [False] * n,
                     [i < cached for i in range(n)], encoder=object())


def step(max_ms: float) -> EncoderStep:
    return EncoderStep(registry=None, rpc=None, seen_images=None, colocated_encode_max_ms=max_ms)


def test_a_burst_goes_to_decode_until_its_encodes_would_stall_past_the_budget(clock):
    costs = CostModel()
    one = costs.encode_ms(1)
    s = step(2.5 * one)
    assert [s.encode_on_decode(new_images(), costs, "decode-a") for _ in range(3)] == [True, True, False]
    assert s.encode_on_decode(new_images(), costs, "decode-b")          # another worker's model thread is free
    clock.now += one / 1000                                              # one encode ran
    assert s.encode_on_decode(new_images(), costs, "decode-a")
    assert not s.encode_on_decode(new_images(), costs, "decode-a")
    clock.now += 10 * one / 1000                                         # all ran: the worker is free again
    assert s.encode_on_decode(new_images(), costs, "decode-a")


def test_a_request_whose_own_encode_is_over_the_budget_goes_to_the_encoder(clock):
    costs = CostModel()
    s = step(1.5 * costs.encode_ms(1))
    assert s.encode_on_decode(new_images(1), costs, "decode-a")
    clock.now += 60
    assert not s.encode_on_decode(new_images(4), costs, "decode-a")      # four images: over the budget alone
    assert s.encode_on_decode(new_images(1), costs, "decode-a")          # a refusal took nothing of the budget


def test_cached_images_and_a_zero_budget_never_go_to_decode(clock):
    costs = CostModel()
    assert not step(1000.0).encode_on_decode(new_images(2, cached=1), costs, "decode-a")
    assert not step(0.0).encode_on_decode(new_images(1), costs, "decode-a")
