"""The connection state table: every state change is an entry, and a missing entry is an error."""

import pytest

from gateway.mqtt.state import CLIENT_PACKETS, TRANSITIONS, Closing, Settled, State, next_state
from gateway.mqtt.actions import Appended, Pulled, SessionOpened
from gateway.mqtt.packets import Auth, Connect, Pingreq, Publish
from gateway.mqtt.reasons import LocalProtocolError, ReasonCode, RemoteProtocolError


def test_every_state_has_a_row():
    assert set(TRANSITIONS) == set(State)


def test_connect_only_first_and_only_once():
    assert next_state(State.AWAIT_CONNECT, Connect) is State.CONNECTING
    for state in (State.CONNECTING, State.CONNECTED):
        with pytest.raises(RemoteProtocolError) as info:
            next_state(state, Connect)
        assert info.value.reason is ReasonCode.PROTOCOL_ERROR
    for packet in set(CLIENT_PACKETS) - {Connect}:
        with pytest.raises(RemoteProtocolError):
            next_state(State.AWAIT_CONNECT, packet)


def test_auth_is_never_accepted():
    for state in (State.AWAIT_CONNECT, State.CONNECTING, State.CONNECTED):
        with pytest.raises(RemoteProtocolError):
            next_state(state, Auth)


def test_packets_before_connack_stay_connecting_and_session_opened_connects():
    assert next_state(State.CONNECTING, Publish) is State.CONNECTING
    assert next_state(State.CONNECTING, SessionOpened) is State.CONNECTED


def test_closing_settles_into_closed_only_through_disconnecting():
    for state in (State.AWAIT_CONNECT, State.CONNECTING, State.CONNECTED):
        assert next_state(state, Closing) is State.DISCONNECTING
        with pytest.raises(LocalProtocolError):
            next_state(state, Settled)
    assert next_state(State.DISCONNECTING, Appended) is State.DISCONNECTING
    assert next_state(State.DISCONNECTING, Settled) is State.CLOSED
    with pytest.raises(LocalProtocolError):
        next_state(State.CLOSED, Closing)


def test_node_events_out_of_place_are_local_errors():
    with pytest.raises(LocalProtocolError):
        next_state(State.AWAIT_CONNECT, Pulled)
    with pytest.raises(LocalProtocolError):
        next_state(State.CONNECTED, SessionOpened)


def test_no_packet_transitions_after_the_close():
    for state in (State.DISCONNECTING, State.CLOSED):
        assert not set(TRANSITIONS[state]) & set(CLIENT_PACKETS)
    assert Pingreq in TRANSITIONS[State.CONNECTED]
