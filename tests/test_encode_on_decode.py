"""Which colocated requests' images go to their decode worker as bytes (``EncoderStep.encode_on_decode``).

Encodes sent to a decode worker run on its model thread, between its steps: a burst of them is one
gap for every sequence running there. So the rule is the stall budget ``colocated_encode_max_ms``
for the encodes still ahead on that worker plus the new one, estimated by the cost model: the first of
a burst runs alone and the second opens the tower call that waits behind it (a call each), and every
later one joins that call with its per-image time alone. The clock is faked; the end-to-end path (the bytes, the encode on
decode, the store) is ``tests/test_colocated_encode.py``.
"""

from __future__ import annotations

import pytest

from gateway import encoder_step
from gateway.encoder_step import EncoderStep, ImagePlan
from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.cost_model import CostModel
from runtime.policy.service_times import ServiceTimes


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


def new_images(n: int = 1, cached: int = 0, tokens: int = 256) -> ImagePlan:
    keys = [f"key-{i}" for i in range(n)]
    return ImagePlan(keys, [pb.ImageRef(cache_key=k, placeholder_tokens=tokens) for k in keys], [False] * n,
                     [i < cached for i in range(n)], encoder=object())


def step(max_ms: float) -> EncoderStep:
    return EncoderStep(registry=None, rpc=None, seen_images=None, colocated_encode_max_ms=max_ms)


def test_a_burst_goes_to_decode_until_its_encodes_would_stall_past_the_budget(clock):
    costs = CostModel()                                                  # a call 10 ms, 40 ms a 256-token image
    one, more = costs.encode_ms(256), costs.encode_added_ms(256)
    assert (one, more) == (50.0, 40.0)
    s = step(2 * one + more + 1)
    sent = [s.encode_on_decode(new_images(), costs, "decode-a") for _ in range(4)]
    assert sent == [True, True, True, False]                             # a call, a call, then joining the second
    assert s.encode_on_decode(new_images(), costs, "decode-b")          # another worker's model thread is free
    clock.now += one / 1000                                              # one call ran
    assert s.encode_on_decode(new_images(), costs, "decode-a")          # what ran left room for one image more
    assert not s.encode_on_decode(new_images(), costs, "decode-a")
    clock.now += 10 * one / 1000                                         # all ran: the worker is free again
    assert s.encode_on_decode(new_images(), costs, "decode-a")
    assert (s._encodes_end["decode-a"] - clock.now) * 1000 == pytest.approx(one)   # a call alone again
    assert s.encode_on_decode(new_images(), costs, "decode-a")          # ... and the one behind it another
    assert (s._encodes_end["decode-a"] - clock.now) * 1000 == pytest.approx(2 * one)


def test_a_request_whose_own_encode_is_over_the_budget_goes_to_the_encoder(clock):
    costs = CostModel()
    s = step(1.5 * costs.encode_ms(256))
    assert s.encode_on_decode(new_images(1), costs, "decode-a")
    clock.now += 60
    assert not s.encode_on_decode(new_images(4), costs, "decode-a")      # four images: over the budget alone
    assert s.encode_on_decode(new_images(1), costs, "decode-a")          # a refusal took nothing of the budget


def test_cached_images_and_a_zero_budget_never_go_to_decode(clock):
    costs = CostModel()
    assert not step(1000.0).encode_on_decode(new_images(2, cached=1), costs, "decode-a")
    assert not step(0.0).encode_on_decode(new_images(1), costs, "decode-a")


def test_a_burst_joins_the_waiting_tower_call_with_its_per_image_time(clock):
    """The demo model's fit on a 2-core host: a tower call 3.6 ms plus 0.36 ms an image (of 16 tokens). A burst of 16
    arriving together: the first runs alone, the second opens the call that waits behind it, the other
    14 join that call: 2 x 3.96 + 14 x 0.36 = 12.96 ms, within the 15 ms default. Priced as 16 whole
    calls one after another (63 ms), three went to the decode worker and 13 to the encoder."""
    costs = CostModel(prior=ServiceTimes(encode_base_ms=3.6, encode_ms_per_token=0.36 / 16))
    s = step(15.0)
    sent = [s.encode_on_decode(new_images(tokens=16), costs, "decode-a") for _ in range(16)]
    assert sent == [True] * 16
    assert (s._encodes_end["decode-a"] - clock.now) * 1000 == pytest.approx(2 * 3.96 + 14 * 0.36)
    assert costs.encode_added_ms(3 * 16) == pytest.approx(3 * 0.36)
    assert step(15.0).encode_on_decode(new_images(tokens=16), costs, "decode-a")


def test_an_image_is_priced_by_its_tokens(clock):
    """The same budget takes a small image to the decode worker and sends a large one to the encoder:
    a 1344x1344 Qwen-VL image (2,304 tokens) is ~36x a 224x224 one's (64) tower work, not the same."""
    costs = CostModel(prior=ServiceTimes(encode_base_ms=3.6, encode_ms_per_token=0.36 / 16))
    assert step(15.0).encode_on_decode(new_images(tokens=64), costs, "decode-a")        # 5.0 ms
    assert not step(15.0).encode_on_decode(new_images(tokens=2304), costs, "decode-a")  # 55.4 ms
