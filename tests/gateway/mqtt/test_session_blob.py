"""The session blob (gateway/mqtt/session.py, ``encode_session``): version 2 keys each stream by (filter, log) and
saves positions with their log; a blob saved by the version before it (no ``v``) still loads, resumes and expires."""

from __future__ import annotations

import msgspec
import pytest

from gateway.mqtt.actions import InFlight, Phase, SavedSubscription, Subscription
from gateway.mqtt.packets import SubscriptionOptions
from gateway.mqtt.session import (BLOB_VERSION, SessionState, clamp_session_blob, decode_session, encode_parts,
                                  encode_session, session_blob_expiry)
from store.api import MAIN_LOG, Position, session_image

SUBSCRIPTIONS = (Subscription("tele/+/temp", "tele/+/temp", SubscriptionOptions(qos=2), subscription_id=7),
                 Subscription("$share/g/jobs/#", "jobs/#", SubscriptionOptions(qos=1), group="g"),
                 Subscription("cmd/dev1", "cmd/dev1", SubscriptionOptions(qos=0)))

STATE = SessionState(
    "dev1", 3600, SUBSCRIPTIONS, offsets={"tele/+/temp": 40, "cmd/dev1": 12},
    cursors={"tele/+/temp": 44, "cmd/dev1": 12},
    awaiting_rel=frozenset({9}), inflight=(InFlight(552, "tele/+/temp", 40, 2, Phase.RELEASED),
                                           InFlight(554, "tele/+/temp", 42, 2)),
    next_packet_id=5, awaiting={3: Position(MAIN_LOG, 123456)}, lanes={"tele/+/temp": 1}, detached=True)
"""A persistent session with a lane, a QoS 2 flow at each phase, a shared and an exact subscription, an inbound
flow the store knows (3) and one it does not (9)."""

BLOB_V1 = bytes.fromhex(
    "8ba9636c69656e745f6964a464657631a86578706972795f73cd0e10ad737562736372697074696f6e739385a666696c746572ab74656c"
    "652f2b2f74656d70a57175657565ab74656c652f2b2f74656d70a76f7074696f6e7384a3716f7302a86e6f5f6c6f63616cc2b372657461"
    "696e5f61735f7075626c6973686564c2af72657461696e5f68616e646c696e6700af737562736372697074696f6e5f696407a567726f75"
    "70c085a666696c746572af2473686172652f672f6a6f62732f23a57175657565a66a6f62732f23a76f7074696f6e7384a3716f7301a86e"
    "6f5f6c6f63616cc2b372657461696e5f61735f7075626c6973686564c2af72657461696e5f68616e646c696e6700af7375627363726970"
    "74696f6e5f6964c0a567726f7570a16785a666696c746572a8636d642f64657631a57175657565a8636d642f64657631a76f7074696f6e"
    "7384a3716f7300a86e6f5f6c6f63616cc2b372657461696e5f61735f7075626c6973686564c2af72657461696e5f68616e646c696e6700"
    "af737562736372697074696f6e5f6964c0a567726f7570c0a76f66667365747382ab74656c652f2b2f74656d7028a8636d642f64657631"
    "0ca7637572736f727382ab74656c652f2b2f74656d702ca8636d642f646576310cac6177616974696e675f72656c9109a8696e666c6967"
    "68749285a97061636b65745f6964cd0228a666696c746572ab74656c652f2b2f74656d70a66f666673657428a3716f7302a57068617365"
    "a872656c656173656485a97061636b65745f6964cd022aa666696c746572ab74656c652f2b2f74656d70a66f66667365742aa3716f7302"
    "a57068617365a97075626c6973686564ae6e6578745f7061636b65745f696405a86177616974696e678103ce0001e240a56c616e657381"
    "ab74656c652f2b2f74656d7001a86465746163686564c3")
"""``STATE`` as the code before positions saved it (commit 9cb2293's ``encode_session``, run once: a map of
``SessionState``'s fields, ``awaiting`` {3: 123456} as a bare CommitLog offset)."""


def test_a_blob_saved_before_positions_loads_with_its_offsets_in_the_one_log():
    assert decode_session(BLOB_V1) == STATE
    assert session_blob_expiry(BLOB_V1) == 3600


def test_a_blob_keys_each_stream_by_filter_and_log_and_its_positions_carry_their_log():
    blob = encode_session(STATE)
    raw = msgspec.msgpack.decode(blob)
    assert raw["v"] == BLOB_VERSION == 2 and "offsets" not in raw and "cursors" not in raw
    assert raw["streams"] == [["tele/+/temp", MAIN_LOG, 40, 44], ["cmd/dev1", MAIN_LOG, 12, 12]]
    assert raw["inflight"] == [[552, "tele/+/temp", MAIN_LOG, 40, 2, "released"],
                               [554, "tele/+/temp", MAIN_LOG, 42, 2, "published"]]
    assert raw["awaiting"] == {3: [MAIN_LOG, 123456]}
    assert decode_session(blob) == STATE and session_blob_expiry(blob) == 3600


def test_a_stream_with_only_a_cursor_or_only_an_offset_round_trips():
    state = SessionState("c", 60, SUBSCRIPTIONS[:1], offsets={"a/#": 3}, cursors={"tele/+/temp": 8})
    assert decode_session(encode_session(state)) == state


def test_a_blob_of_the_old_version_is_clamped_into_the_new_one():
    """After a power loss the store pulls every blob back to the recovered heads (``clamp_session_blob``): an old
    blob comes out in the new format with the same session, pulled back."""
    clamped = clamp_session_blob(BLOB_V1, lambda queue: 41)
    assert clamped is not None and msgspec.msgpack.decode(clamped)["v"] == BLOB_VERSION
    state = decode_session(clamped)
    assert (state.offsets, state.cursors) == ({"tele/+/temp": 40, "cmd/dev1": 12}, {"tele/+/temp": 41, "cmd/dev1": 12})
    assert [e.packet_id for e in state.inflight] == [552]  # the PUBREL owed stays; the PUBLISH past the head goes


@pytest.mark.parametrize("change", [{"v": 3}, {"streams": [["a/#", 1, 5, 5]]}, {"awaiting": {3: [2, 10]}}],
                         ids=["a later version", "a stream of another log", "a flow in another log"])
def test_a_blob_this_code_cannot_resume_is_refused_as_unreadable(change):
    raw = msgspec.msgpack.decode(encode_session(STATE)) | change
    blob = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.DecodeError):
        decode_session(blob)
    assert session_blob_expiry(blob) == 0 and clamp_session_blob(blob, lambda queue: 0) is None


def test_parts_patched_after_a_blob_replace_add_and_remove_its_subscriptions():
    # A SUBSCRIBE stores its own filters (PatchSession), kept beside the blob: each part is the subscription as it
    # is now (a re-SUBSCRIBE's options, a new one's start), an empty part an UNSUBSCRIBE, whose messages in flight
    # go as in a save. The blob and its parts resume as one session [MQTT-3.1.2-4].
    replaced = Subscription("tele/+/temp", "tele/+/temp", SubscriptionOptions(qos=1))
    new = Subscription("cfg/#", "cfg/#", SubscriptionOptions(qos=1, no_local=True))
    parts = encode_parts({"tele/+/temp": SavedSubscription(replaced, 1, 41, 44),
                          "cfg/#": SavedSubscription(new, 2, 9, 9), "cmd/dev1": None})
    stored = session_image(encode_session(STATE), parts)
    state = decode_session(stored)
    assert state.subscriptions == (replaced, SUBSCRIPTIONS[1], new)  # in order
    assert state.offsets == {"tele/+/temp": 41, "cfg/#": 9} and state.cursors == {"tele/+/temp": 44, "cfg/#": 9}
    assert state.lanes == {"tele/+/temp": 1, "cfg/#": 2}
    assert state.inflight == STATE.inflight and state.awaiting == STATE.awaiting  # tele/+/temp's flows stay
    assert session_blob_expiry(stored) == 3600
    assert decode_session(session_image(encode_session(STATE), {})) == STATE
    unsubscribed = decode_session(session_image(encode_session(STATE), encode_parts({"tele/+/temp": None})))
    assert unsubscribed.inflight == () and "tele/+/temp" not in unsubscribed.lanes | unsubscribed.offsets
