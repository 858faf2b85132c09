"""The node's one read task for plain TCP sockets (gateway/node/poller.py), alone and under a node's connections."""

import logging
import socket

import pytest
import trio
import trio.testing

from gateway.mqtt.packets import MQTT_311, Puback, Publish, Subscribe, SubscriptionOptions
from gateway.node.poller import FLOOD_READ_BYTES, MAX_EVENTS, ROUND_BYTES, Poller
from tests.helpers.mqtt_fixtures import raw_client, running_node


class Reads:
    """A poller's reader made of a function that reads once and returns the bytes read."""

    def __init__(self, read, read_size: int) -> None:
        self.readable = read
        self.read_size = read_size
        self.gone_calls = 0

    def gone(self) -> None:
        self.gone_calls += 1


def pairs(count: int) -> list[tuple[socket.socket, socket.socket]]:
    made = [socket.socketpair() for _ in range(count)]
    for ours, _ in made:
        ours.setblocking(False)
    return made


async def wait_for(condition, what: str) -> None:
    with trio.fail_after(5):
        while not condition():
            await trio.sleep(0.001)
    assert condition(), what


def register_reads(poller: Poller, sockets: list[tuple[socket.socket, socket.socket]], size: int, on_read) -> None:
    """Register each socket with a callback that reads up to ``size`` bytes and reports its index (``on_read``)."""
    for index, (ours, _) in enumerate(sockets):
        def callback(index: int = index, sock: socket.socket = ours) -> int:
            try:
                data = sock.recv(size)
            except BlockingIOError:  # a read that filled its buffer is tried again: nothing was left
                return 0
            on_read(index)
            return len(data)
        poller.register(ours.fileno(), Reads(callback, size))


async def serve_until(poller: Poller, condition, what: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        await wait_for(condition, what)
        nursery.cancel_scope.cancel()


async def test_readable_sockets_are_served_in_one_round_then_the_round_ends():
    seen: list[object] = []
    poller = Poller(lambda _: seen.append(("end", poller.round is not None)))
    sockets = pairs(3)
    try:
        def reader(index: int, sock: socket.socket):
            def callback() -> int:
                data = sock.recv(100)
                seen.append((index, data, poller.round is not None))
                return len(data)
            return callback

        for index, (ours, _) in enumerate(sockets):
            poller.register(ours.fileno(), Reads(reader(index, ours), 100))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []  # nothing readable: no round
            for index, (_, theirs) in enumerate(sockets):
                theirs.send(b"m%d" % index)
            await wait_for(lambda: ("end", False) in seen, "a round")
            assert sorted(seen[:3]) == [(0, b"m0", True), (1, b"m1", True), (2, b"m2", True)]
            assert seen[3:] == [("end", False)]
            nursery.cancel_scope.cancel()
    finally:
        for ours, theirs in sockets:
            ours.close()
            theirs.close()


async def test_an_unregistered_socket_is_not_read_and_unregister_is_idempotent():
    calls: list[str] = []
    poller = Poller()
    (gone, gone_peer), (kept, kept_peer) = pairs(2)
    with gone, gone_peer, kept, kept_peer:
        def read_kept() -> int:
            calls.append(kept.recv(100).decode())
            return 4

        poller.register(gone.fileno(), Reads(lambda: calls.append("gone") or 1, 100))
        poller.register(kept.fileno(), Reads(read_kept, 100))
        poller.unregister(gone.fileno())
        poller.unregister(gone.fileno())
        assert len(poller) == 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            gone_peer.send(b"x")
            kept_peer.send(b"kept")
            await wait_for(lambda: calls, "the registered socket read")  # both were readable in that round
            assert calls == ["kept"]
            nursery.cancel_scope.cancel()
    poller.unregister(kept.fileno())  # after the socket and the set are closed: still no error


async def test_a_failing_reader_is_logged_and_dropped_and_the_others_go_on_until_the_poller_stops(caplog):
    """A dropped reader is told (``gone``: its connection closes), and so is every reader when the poller stops:
    an idle connection has no task that the node's end would cancel (issue 31)."""
    got: list[bytes] = []
    poller = Poller()
    (bad, bad_peer), (good, good_peer) = pairs(2)
    with bad, bad_peer, good, good_peer:
        def fail() -> int:
            raise RuntimeError("a bug in one connection")

        def read_good() -> int:
            got.append(good.recv(100))
            return len(got[-1])

        bad_reads, good_reads = Reads(fail, 100), Reads(read_good, 100)
        poller.register(bad.fileno(), bad_reads)
        poller.register(good.fileno(), good_reads)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            with caplog.at_level(logging.ERROR, logger="gateway.node.poller"):
                bad_peer.send(b"x")
                await wait_for(lambda: len(poller) == 1, "the failing socket dropped")
            good_peer.send(b"still served")
            await wait_for(lambda: got == [b"still served"], "the other socket read")
            assert (bad_reads.gone_calls, good_reads.gone_calls) == (1, 0)
            nursery.cancel_scope.cancel()
        assert (bad_reads.gone_calls, good_reads.gone_calls) == (1, 1) and len(poller) == 0
    assert "a bug in one connection" in caplog.text


async def test_sockets_are_read_in_the_order_their_bytes_arrived_even_one_read_in_the_round_before():
    """B is read in a round, then bytes arrive for A and then for B before the next round: A is read first.
    A level-triggered set lists B first (it re-queues B when it reports it), so a PUBLISH read on B was applied
    before a SUBSCRIBE that had arrived earlier on A (gateway/node/order.py)."""
    read: list[str] = []
    poller = Poller(lambda _: read.append("end"))
    (a, a_peer), (b, b_peer) = pairs(2)
    with a, a_peer, b, b_peer:
        def read_a() -> int:
            data = a.recv(100)
            read.append("a")
            return len(data)

        def read_b() -> int:
            data = b.recv(100)
            read.append("b")
            if data == b"first":  # both arrive while B's first read is handled: before the next round
                a_peer.send(b"subscribe")
                b_peer.send(b"publish")
            return len(data)

        poller.register(a.fileno(), Reads(read_a, 100))
        poller.register(b.fileno(), Reads(read_b, 100))
        b_peer.send(b"first")
        await serve_until(poller, lambda: read.count("end") >= 2 and len(read) >= 5, "three reads")
        assert read[:5] == ["b", "end", "a", "b", "end"]


async def test_a_read_that_fills_its_buffer_is_read_again_without_new_bytes():
    """Edge-triggered, the kernel reports a socket once for the bytes it has: a read that took ``read_size``
    may have left some, which the next round reads."""
    got: list[bytes] = []
    poller = Poller()
    ours, theirs = pairs(1)[0]
    with ours, theirs:
        def read() -> int:
            got.append(ours.recv(4))
            return len(got[-1])

        poller.register(ours.fileno(), Reads(read, 4))
        theirs.send(b"0123456789")
        await serve_until(poller, lambda: b"".join(got) == b"0123456789", "every byte read")
        assert got == [b"0123", b"4567", b"89"]


async def test_the_end_that_came_with_the_last_bytes_is_read_too():
    """Bytes and the end arrive before the poller looks: one report for both, and a short read; the socket is read
    again until the end (a client that sent a partial packet and closed was held open, its bytes with it)."""
    got: list[bytes] = []
    poller = Poller()
    ours, theirs = pairs(1)[0]
    with ours, theirs:
        def read() -> int:
            try:
                data = ours.recv(100)
            except BlockingIOError:
                return 0
            got.append(data)
            if not data:
                poller.unregister(ours.fileno())
            return len(data)

        poller.register(ours.fileno(), Reads(read, 100))
        theirs.send(b"\x10")
        theirs.shutdown(socket.SHUT_WR)
        await serve_until(poller, lambda: b"" in got, "the end read")
        assert got == [b"\x10", b""]


async def test_more_readable_sockets_than_a_round_takes_are_all_served_over_several_rounds():
    """Small reads (a subscriber's PUBACKs) fill a round up to MAX_EVENTS sockets."""
    count = MAX_EVENTS * 2 + 5
    small = 512  # 128 PUBACKs a read
    assert small * MAX_EVENTS < ROUND_BYTES and small < FLOOD_READ_BYTES  # only MAX_EVENTS ends the round
    read: set[int] = set()
    rounds: list[int] = []
    poller = Poller(lambda _: rounds.append(len(read)))
    sockets = pairs(count)
    try:
        register_reads(poller, sockets, small, read.add)
        for _, theirs in sockets:
            theirs.send(b"x" * small)
        await serve_until(poller, lambda: len(read) == count, "every socket read")
        assert len(rounds) >= 3 and rounds[0] == MAX_EVENTS  # a round stops at MAX_EVENTS, then yields
    finally:
        for ours, theirs in sockets:
            ours.close()
            theirs.close()


async def test_a_round_stops_at_its_byte_budget_and_the_next_rounds_serve_the_sockets_it_did_not_reach():
    """Flooding sockets take turns: every one is read before any is read again (the kernel would list the
    same first few first every time)."""
    chunk = FLOOD_READ_BYTES // 2  # not a flood read: only the byte budget ends a round
    order: list[int] = []
    rounds: list[int] = []
    poller = Poller(lambda _: rounds.append(len(order)))
    sockets = pairs(ROUND_BYTES // chunk * 2 + 1)  # more sockets than one round's budget reads
    try:
        register_reads(poller, sockets, chunk, order.append)
        for _, theirs in sockets:
            theirs.setblocking(False)  # a send the buffer cannot take fails here instead of hanging
            theirs.send(b"x" * chunk * 2)  # two reads' worth: each socket stays readable after its first read
        await serve_until(poller, lambda: len(order) >= 2 * len(sockets), "two reads per socket")
        assert rounds[0] == ROUND_BYTES // chunk  # the budget, not MAX_EVENTS, ended the first round
        assert sorted(order[:len(sockets)]) == list(range(len(sockets)))
    finally:
        for ours, theirs in sockets:
            ours.close()
            theirs.close()


@pytest.mark.slow
def test_a_311_flood_past_the_inflight_limit_pauses_reading_and_loses_nothing(tmp_path):
    """The reader takes the socket out of the poller while the channel holds PUBLISHes beyond the in-flight
    limit, and back in once the batched appends free room: every message stored, acknowledged and delivered
    in order."""
    batches, per_batch = 3, 200  # a read holds at most 8 in flight + 256 waiting (max_queued_packets) in 3.1.1
    count = batches * per_batch
    with running_node(tmp_path / "data", "--mqtt-receive-maximum", "8") as node:
        with raw_client(node.port, MQTT_311) as sub, raw_client(node.port, MQTT_311) as pub:
            sub.connect("flood-sub")
            sub.send(Subscribe(1, (("flood/#", SubscriptionOptions(qos=1)),)))
            sub.receive()
            pub.connect("flood-pub")
            for batch in range(batches):
                ids = range(batch * per_batch, (batch + 1) * per_batch)
                pub.send(*(Publish("flood/t", b"%d" % i, qos=1, packet_id=i + 1) for i in ids))
                assert [pub.receive() for _ in ids] == [Puback(i + 1) for i in ids]
            payloads = []
            while len(payloads) < count:
                packet = sub.receive()
                assert isinstance(packet, Publish), packet
                payloads.append(packet.payload)
                sub.send(Puback(packet.packet_id))
            assert payloads == [b"%d" % i for i in range(count)]
    assert node.proc.returncode == 0
    assert not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


async def test_a_flooding_sockets_read_ends_its_round():
    """A read of FLOOD_READ_BYTES or more is a round of its own: the other tasks (deliveries) get a turn."""
    rounds: list[list[int]] = [[]]
    poller = Poller(lambda _: rounds.append([]))
    sockets = pairs(3)
    try:
        register_reads(poller, sockets, FLOOD_READ_BYTES, lambda index: rounds[-1].append(index))
        for _, theirs in sockets:
            theirs.setblocking(False)
            theirs.send(b"x" * FLOOD_READ_BYTES)
        await serve_until(poller, lambda: sum(map(len, rounds)) >= len(sockets), "every socket read")
        assert [len(r) for r in rounds if r] == [1, 1, 1]
    finally:
        for ours, theirs in sockets:
            ours.close()
            theirs.close()
