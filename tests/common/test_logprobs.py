"""The log-probability transfer type: its layout checks, slicing and joining, and its two encodings."""

from __future__ import annotations

import base64
import math

import pytest

from common.logprobs import NO_LOGPROBS, Logprobs, unpredicted
from common.pb import executor_pb2 as pb

THREE = Logprobs.build(
    [5, 6, 7],
    [-0.5, -0.25, -3.0],
    [[5, 1], [6, 2], [9, 7]],
    [[-0.5, -1.5], [-0.25, -2.0], [-0.125, -3.0]],
    ranks=[1, 1, 2],
)


def test_layout_is_checked() -> None:
    with pytest.raises(ValueError):
        Logprobs((1, 2), (-1.0,))
    with pytest.raises(ValueError):
        Logprobs((1,), (-1.0,), 2, (3,), (-2.0,))


def test_positions_slice_and_join_back() -> None:
    assert THREE.top(2) == [(9, -0.125), (7, -3.0)]
    assert THREE.slice(0, 1).then(THREE.slice(1)) == THREE
    assert NO_LOGPROBS.then(THREE) == THREE == THREE.then(NO_LOGPROBS)
    with pytest.raises(ValueError):
        THREE.then(Logprobs((1,), (-1.0,)))


@pytest.mark.parametrize("logprobs", [THREE, NO_LOGPROBS, Logprobs((3,), (-0.5,))], ids=["top-2", "empty", "top-0"])
def test_packed_and_wire_round_trips_are_exact(logprobs: Logprobs) -> None:
    # Every value above is a float32: both encodings keep them bit for bit.
    assert Logprobs.unpack(logprobs.pack()) == logprobs
    assert Logprobs.from_pb(pb.TokenLogprobs.FromString(logprobs.to_pb().SerializeToString())) == logprobs
    assert logprobs.pack().isascii()  # a Redis stream field, as text


def test_entries_written_before_ranks_were_kept_read_as_unranked() -> None:
    # A stream entry or an executor from before ranks: the same positions, every rank unknown (0).
    unranked = Logprobs(THREE.token_ids, THREE.logprobs, 2, THREE.top_ids, THREE.top_logprobs)
    assert unranked.ranks == (0, 0, 0)
    old_entry = base64.b64encode(base64.b64decode(THREE.pack())[: -4 * len(THREE)]).decode()
    assert Logprobs.unpack(old_entry) == unranked
    old_wire = THREE.to_pb()
    del old_wire.ranks[:]
    assert Logprobs.from_pb(old_wire) == unranked
    assert THREE.slice(1).ranks == (1, 2) and unranked.then(THREE).ranks == (0, 0, 0, 1, 1, 2)


def test_the_unpredicted_first_prompt_token_survives_packing() -> None:
    first = unpredicted(1, 2).then(THREE.slice(0, 1))
    back = Logprobs.unpack(first.pack())
    assert not back.predicted(0) and math.isnan(back.logprobs[0]) and back.predicted(1)
    assert back.token_ids == (1, 5) and back.top(1) == [(5, -0.5), (1, -1.5)]


@pytest.mark.parametrize("text", ["", "!!", "AAAA", THREE.pack()[:-4]])
def test_malformed_packed_logprobs_raise(text: str) -> None:
    with pytest.raises(ValueError):
        Logprobs.unpack(text)
