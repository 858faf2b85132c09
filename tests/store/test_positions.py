"""Positions, not offsets (store/api.py): what the seam says of a record is the log it is in and its offset there,
the same through the in-process store and the RPC (one store has one log, ``MAIN_LOG``, for now)."""

from __future__ import annotations

import msgspec
import pytest

from store.api import MAIN_LOG, Flow, NewMessage, Position, Positions
from store.local import LocalStore
from store.rpc import wire as rpc
from store.rpc.client import RemoteStore
from store.rpc.server import serve_rpc


def test_a_position_is_two_small_ints_on_the_wire_and_orders_within_its_log():
    assert msgspec.msgpack.encode(Position(MAIN_LOG, 300)) == b"\x92\x00\xcd\x01\x2c"
    assert msgspec.msgpack.decode(b"\x92\x03\x07", type=Position) == Position(3, 7)
    assert Position(0, 5) < Position(0, 9) and Position(0, 9) != Position(1, 9)
    assert {Position(0, 5): "a"}[Position(0, 5)] == "a"  # frozen: a key


def test_an_append_answers_one_log_and_its_offsets_and_makes_a_position_when_asked():
    placed = Positions(MAIN_LOG, [40, 97, 130])
    assert msgspec.msgpack.encode(placed) == msgspec.msgpack.encode([MAIN_LOG, [40, 97, 130]])  # no struct a message
    assert len(placed) == 3 and placed[1] == Position(MAIN_LOG, 97) and list(placed)[-1] == Position(MAIN_LOG, 130)
    first, *_ = placed
    assert first == Position(MAIN_LOG, 40)


def test_a_flow_names_its_fields_unpacks_as_a_tuple_and_travels_with_its_position():
    flow = Flow("dev1", 7, Position(MAIN_LOG, 1024))
    client, packet_id, position = flow
    assert (client, packet_id, position.offset) == (flow.client_id, flow.packet_id, 1024) == ("dev1", 7, 1024)
    request = rpc.ReleaseAwaiting(3, [flow])
    decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
    decoder.receive_data(rpc.encode(request))
    assert decoder.next_message() == request and type(decoder.next_message()) is not rpc.ReleaseAwaiting


async def check_positions(store, other_log: Position) -> None:
    """The store's answers name its one log; a position of another log is refused, and changes nothing."""
    placed = await store.append([NewMessage("t/a", b"1"), NewMessage("t/b", b"2", "dev1", qos=2, packet_id=9)])
    assert type(placed) is Positions and placed.log == MAIN_LOG and len(placed) == 2
    assert placed[0] < placed[1]
    assert await store.awaiting_release("dev1") == {9: placed[1]}
    with pytest.raises(ValueError, match="no log 1"):
        await store.release_awaiting([Flow("dev1", 9, other_log)])
    assert await store.awaiting_release("dev1") == {9: placed[1]}
    await store.release_awaiting([Flow("dev1", 9, placed[1])])
    assert await store.awaiting_release("dev1") == {}
    span = await store.read_log(placed[0], 0)
    assert span.log == MAIN_LOG and span.start == placed[0].offset
    with pytest.raises(ValueError, match="no log 1"):
        await store.read_log(other_log, 0)


async def test_the_local_and_the_remote_store_answer_positions(store_small_records, nursery):
    local = LocalStore(store_small_records, "gw-local")
    try:
        await local.open_session("dev1", clean_start=True, expiry_s=60)
        await check_positions(local, Position(1, 0))
    finally:
        local.close()
    listeners = await nursery.start(lambda task_status: serve_rpc(store_small_records, "127.0.0.1", 0,
                                                                  task_status=task_status))
    port = listeners[0].socket.getsockname()[1]
    async with RemoteStore.connect("127.0.0.1", port, node="gw-remote") as remote:
        await remote.open_session("dev1", clean_start=True, expiry_s=60)
        await check_positions(remote, Position(1, 0))
        [each] = await remote.append_groups([[NewMessage("t/c", b"3")]])
        assert each[0] == Position(MAIN_LOG, each.offsets[0])  # a back-end producer's: positions a group
