"""The rope-delta rule and the token digest (issue 17), without processes.

On the code before, ``runtime.worker.rope_delta`` did not exist and ``token_digest``
took no grids or delta (a wrong grid or delta digested the same).
"""

from __future__ import annotations

import pytest

from proto.epd.v1 import epd_pb2 as pb
from runtime.model.families import PositionKind
from runtime.worker.rope_delta import RopeDeltaRule
from runtime.worker.wire import ref_grids, token_digest

MROPE, ONE_D = RopeDeltaRule(PositionKind.MROPE), RopeDeltaRule(PositionKind.ONE_D)


def test_an_absent_delta_is_an_error_for_m_rope_and_zero_for_one_d():
    assert MROPE.read(pb.ReserveRequest()) is None and ONE_D.read(pb.ReserveRequest()) == 0
    assert MROPE.read(pb.KVChunk(rope_delta=0)) == 0          # optional: a sent 0 is not an absent one
    assert MROPE.read(pb.PrefillRequest(rope_delta=-17)) == -17
    assert "missing" in MROPE.invalid(None, "Reserve") and MROPE.invalid(-5, "Reserve") is None
    assert ONE_D.invalid(0, "Reserve") is None and "1-D" in ONE_D.invalid(3, "Reserve")


def test_problem_names_what_disagrees():
    assert MROPE.problem(-5, -5, "the chunk") is None
    assert "mismatch" in MROPE.problem(-5, 0, "the chunk") and "-5" in MROPE.problem(-5, 0, "the chunk")
    assert "missing: the chunk" in MROPE.problem(-5, None, "the chunk")
    assert "missing: the reservation" in MROPE.problem(None, -5, "the chunk")


def test_the_digest_covers_grids_and_delta_and_a_one_d_prompt_digests_as_before():
    ids, keys = [1, 2, 3, 4], ["a", "b"]
    plain = token_digest(ids, keys)
    assert token_digest(ids, keys, [None, None], 0) == plain == token_digest(ids, keys, ref_grids(
        [pb.ImageRef(cache_key=k) for k in keys]), 0)
    with_grids = token_digest(ids, keys, [(1, 4, 8), (1, 8, 4)], -3)
    assert len({plain, with_grids, token_digest(ids, keys, [(1, 8, 4), (1, 4, 8)], -3),
                token_digest(ids, keys, [(1, 4, 8), (1, 8, 4)], -2)}) == 4
    with pytest.raises(ValueError):
        token_digest(ids, keys, [(1, 4, 8)], 0)
