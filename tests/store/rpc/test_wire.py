"""The RPC wire format (store/rpc/wire.py): frames, messages, and what broken input does."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from store.api import AdminOp, LogSpan, NewMessage, Positions, PullRequest, StoreStatistics
from store.rpc import wire as rpc

CLIENT_SAMPLES = [
    rpc.Hello(rpc.PROTOCOL_VERSION, "gw-1"),
    rpc.Heartbeat(),
    rpc.Watch({"a/#": 2, "a/b": -1}),
    rpc.Reattach("dev1", 60, NewMessage("will/dev1", b"gone", "dev1", 1, True, b"\x01\x02", 1700), 3, epoch=2),
    rpc.AppendRequest(1, [[NewMessage("a/b", b"x")], [NewMessage("a/c", b"", qos=2, packet_id=7)]], durable=True),
    rpc.Pull(2, [PullRequest("a/#", 0, 32, 1 << 20)]),
    rpc.Activate(3, "a/+", "dev1"),
    rpc.ActivateAll(3, ["a/+", "b"], "dev1"),
    rpc.Release(4, "a/+", "dev1"),
    rpc.MaxOffsets(5, ["a/b", "a/c"]),
    rpc.GetOffsets(6, "dev1"),
    rpc.CommitOffsets(7, {"dev1": {"a/b": 3}, "$share/g": {"a/+": 9}}),
    rpc.GetRetained(9, "a/#"),
    rpc.OpenSession(10, "dev1", False, 60, NewMessage("will/dev1", b"gone", "dev1"), 5),
    rpc.CloseSession(11, "dev1", 60, None, epoch=3),
    rpc.SaveSession(12, "dev1", b"\x00blob"),
    rpc.LoadSession(13, "dev1"),
    rpc.EndSession(14, "dev1"),
    rpc.ListSessions(15),
    rpc.GetStatistics(16),
    rpc.Join(17, "$share/g", "a/+", "dev1", "latest"),
    rpc.Claim(18, "$share/g", "a/+", 10, 1 << 20, 0, "dev1"),
    rpc.Ack(19, "$share/g", "a/+", [], "dev1", below=4),
    rpc.Leave(20, "$group/g", "a/+", "m1"),
    rpc.AdminCall(21, "dev1", AdminOp.SESSION),
    rpc.AdminCallAll(22, AdminOp.CLIENTS, b'{"search":"dev"}'),
    rpc.AdminAnswer(23, b"[]"),
]

SERVER_SAMPLES = [
    rpc.Welcome(rpc.PROTOCOL_VERSION, "gw-1", 1.0, 5.0),
    rpc.Heartbeat(),
    rpc.Error(0, rpc.ErrorKind.VERSION, "no"),
    rpc.Events({"a/b": 7}),
    rpc.ClientMoved("dev1"),
    rpc.Appended(1, [Positions(0, [0, 51]), Positions(0, [])],
                 {1: rpc.Error(0, rpc.ErrorKind.RECORD_TOO_LARGE, "too big")}),
    rpc.Pulled(2, [rpc.RawRecords([(0, 0, b"record")], 1, False), rpc.RawRecords([], 5, True)]),
    rpc.Claimed(18, rpc.RawRecords([(4, 100, b"record"), (5, 140, b"batch")], 9, False, {1: (1, 4)})),
    rpc.Offsets(5, [3, 0]),
    rpc.Value(3, 17),
    rpc.Starts(3, [17, rpc.Error(3, rpc.ErrorKind.TOPIC, "bad filter"), 0]),
    rpc.Value(4, True),
    rpc.Value(6, {"a/b": 3}),
    rpc.Value(11, b"blob"),
    rpc.AdminAsk(14, "", AdminOp.SESSIONS, b""),
    rpc.NodeAnswers(14, {"gw-2": b"[]"}, ["gw-3"]),
    rpc.Value(11),
    rpc.Names(15, ["dev1", "dev2"]),
    rpc.Done(7),
    rpc.Statistics(16, StoreStatistics(1, 2, 3, 4, 5, 6, 7, 8, 9, {"gw-1": 8})),
    rpc.RecordList(9, [(0, b"record")]),
    rpc.LogBytes(22, LogSpan(0, 0, b"log", 3, 3, 0)),
]


@pytest.mark.parametrize("message", CLIENT_SAMPLES, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip(message):
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    decoder.receive_data(rpc.encode(message))
    decoded = decoder.next_message()
    assert decoded == message and type(decoded) is type(message)
    assert decoder.next_message() is rpc.NEED_DATA


@pytest.mark.parametrize("message", SERVER_SAMPLES, ids=lambda m: type(m).__name__)
def test_server_messages_round_trip(message):
    decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
    decoder.receive_data(rpc.encode(message))
    decoded = decoder.next_message()
    assert decoded == message and type(decoded) is type(message)


def test_value_keeps_bool_and_int_apart():
    decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
    decoder.receive_data(rpc.encode(rpc.Value(1, False)) + rpc.encode(rpc.Value(2, 0)))
    assert decoder.next_message().value is False
    zero = decoder.next_message().value
    assert zero == 0 and type(zero) is int


def test_frame_is_a_big_endian_length_then_msgpack():
    frame = rpc.encode(rpc.Heartbeat())
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert msgspec.msgpack.decode(frame[4:]) == ["hb"]


def test_fragmented_frames_byte_by_byte():
    stream = b"".join(rpc.encode(m) for m in CLIENT_SAMPLES)
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    received = []
    for i in range(len(stream)):
        decoder.receive_data(stream[i : i + 1])
        while (message := decoder.next_message()) is not rpc.NEED_DATA:
            received.append(message)
    assert received == CLIENT_SAMPLES


def test_many_frames_in_one_chunk_and_a_partial_tail():
    frames = [rpc.encode(m) for m in SERVER_SAMPLES]
    decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
    decoder.receive_data(b"".join(frames) + frames[0][:5])
    received = []
    while (message := decoder.next_message()) is not rpc.NEED_DATA:
        received.append(message)
    assert received == SERVER_SAMPLES
    decoder.receive_data(frames[0][5:])
    assert decoder.next_message() == SERVER_SAMPLES[0]


def test_oversized_length_is_refused_before_the_body_arrives():
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES, max_frame_bytes=1024)
    decoder.receive_data((1025).to_bytes(4, "big"))
    with pytest.raises(rpc.RpcProtocolError, match="exceeds the limit of 1024"):
        decoder.next_message()


def test_default_limit_refuses_a_length_of_gigabytes():
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    decoder.receive_data(b"\xff\xff\xff\xff")
    with pytest.raises(rpc.RpcProtocolError, match="exceeds the limit"):
        decoder.next_message()


@pytest.mark.parametrize("body, why", [
    (b"\xc1", "malformed"),  # never used in msgpack
    (msgspec.msgpack.encode(["nosuchtag", 1]), "malformed"),
    (msgspec.msgpack.encode(["append", "not-an-id", []]), "malformed"),
    (msgspec.msgpack.encode({"t": "hb"}), "malformed"),  # a map where an array is expected
    (msgspec.msgpack.encode(["hello", 1]), "malformed"),  # a field missing
])
def test_malformed_frames_are_protocol_errors(body, why):
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    decoder.receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(rpc.RpcProtocolError, match=why):
        decoder.next_message()


def test_a_server_message_is_not_a_client_message():
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    decoder.receive_data(rpc.encode(rpc.Events({"a": 1})))
    with pytest.raises(rpc.RpcProtocolError):
        decoder.next_message()


def test_end_of_stream_between_frames_is_clean_and_inside_one_is_an_error():
    frame = rpc.encode(rpc.Heartbeat())
    clean = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    clean.receive_data(frame)
    clean.receive_data(b"")
    assert not clean.eof
    assert clean.next_message() == rpc.Heartbeat()
    assert clean.next_message() is rpc.NEED_DATA and clean.eof
    for cut in (2, len(frame) - 1):
        torn = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
        torn.receive_data(frame[:cut])
        torn.receive_data(b"")
        with pytest.raises(rpc.RpcProtocolError, match="ended inside a frame"):
            torn.next_message()


def test_encoding_a_message_larger_than_a_frame_is_refused():
    huge = rpc.AppendRequest(1, [[NewMessage("a", b"\0" * (rpc.MAX_FRAME_BYTES + 1))]])
    with pytest.raises(rpc.RpcProtocolError, match="exceeds the frame limit"):
        rpc.encode(huge)


@given(st.binary(max_size=256), st.integers(min_value=1, max_value=17))
def test_arbitrary_bytes_never_escape_as_another_exception(data, chunk):
    check_decodes_or_refuses(data, chunk)


def check_decodes_or_refuses(data: bytes, chunk: int) -> None:
    """Feeding ``data`` in ``chunk``-sized pieces yields messages or RpcProtocolError, never another exception."""
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES, max_frame_bytes=4096)
    try:
        for i in range(0, len(data), chunk):
            decoder.receive_data(data[i : i + chunk])
            while decoder.next_message() is not rpc.NEED_DATA:
                pass
        decoder.receive_data(b"")
        while decoder.next_message() is not rpc.NEED_DATA:
            pass
    except rpc.RpcProtocolError:
        pass


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:7883", ("127.0.0.1", 7883)),
    ("store.local:0", ("store.local", 0)),
    ("[::1]:7883", ("::1", 7883)),
])
def test_parse_address(text, expected):
    assert rpc.parse_address(text) == expected


@pytest.mark.parametrize("text", ["7883", "host:", ":7883", "host:port", "host:70000", ""])
def test_parse_address_refuses(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        rpc.parse_address(text)
