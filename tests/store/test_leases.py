"""Node leases and what the store keeps for their clients: presence, wills, session expiry (store/leases.py).

On trio's virtual clock (pytest-trio's ``autojump_clock``): a lease of 5 s and wills delayed by minutes cost
no real time. The restarts are new ``Leases`` over the same client ledger in a real RocksDB (store/ledger.py), which
applies the control records the leases write as dispatch would; the ledger's times are wall-clock, so an entry
closed "long ago" is written with that time.
"""

import pytest
import trio
import trio.testing

from store.api import NewMessage
from store.leases import NEVER_EXPIRES, Leases
from store.control import encode_control
from store.ledger import ClientEntry, ClientLedger, entry_control
from store.log.record import now_ms
from store.rocks import open_db

LEASE_S = 5.0


def will(client_id: str) -> NewMessage:
    return NewMessage(f"will/{client_id}", b"gone", client_id, 1)


class Store:
    """The store's side of the leases: what was appended and which sessions ended, and when (virtual time)."""

    def __init__(self):
        self.appended = []
        self.ended = []
        self.moved = []
        self.changed = trio.Event()

    async def append(self, messages):
        self.appended += [(trio.current_time(), m.topic) for m in messages]
        self._changed()
        return [0] * len(messages)

    async def end_session(self, client_id):
        self.ended.append((trio.current_time(), client_id))
        self._changed()

    def on_moved(self, node, client_id):
        self.moved.append((node, client_id))

    def _changed(self):
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, condition):
        while not condition():
            await self.changed.wait()

    def leases(self, nursery, ledger=None) -> Leases:
        return Leases(nursery, LEASE_S, append=self.append, end_session=self.end_session, on_moved=self.on_moved,
                      write=ledger.write if ledger is not None else None)


class Ledger:
    """A client ledger over a real RocksDB that applies the records written to it at once, in order."""

    def __init__(self, db):
        self.ledger = ClientLedger(db)
        self.offset = 0

    async def write(self, controls):
        for control in controls:
            self.put_control(control)
        await trio.lowlevel.checkpoint()

    def put_control(self, control):
        _, record = encode_control(control, 1, 1 << 20)
        record.offset = self.offset
        self.offset += record.size
        self.ledger.apply(record, control)

    def put(self, client_id, entry):
        self.put_control(entry_control(client_id, entry))

    def entries(self):
        return self.ledger.entries()


def open_(leases, node, client_id, *, expiry_s=0, delay=0, with_will=True, clean_start=False):
    return leases.open(node, client_id, expiry_s=expiry_s, will=will(client_id) if with_will else None,
                       will_delay_s=delay, clean_start=clean_start)


async def test_wills_fire_lease_plus_delay_after_the_last_frame(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        open_(leases, "gw1", "a")
        open_(leases, "gw1", "b", delay=3)
        await trio.sleep(2)
        leases.seen("gw1")
        last_frame = trio.current_time()
        leases.disconnected("gw1")
        await store.wait_for(lambda: len(store.appended) == 2)
        assert [(t - last_frame, topic) for t, topic in store.appended] == [(LEASE_S, "will/a"), (LEASE_S + 3, "will/b")]
        stats = leases.statistics()
        assert (stats.nodes, stats.clients, stats.wills_fired, stats.leases_ended) == (0, 0, 2, 1)


async def test_reconnecting_within_the_lease_keeps_the_clients(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        open_(leases, "gw1", "a", expiry_s=1)
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S - 1)
        leases.connected("gw1")
        await trio.sleep(10 * LEASE_S)
        assert store.appended == [] and store.ended == []
        assert leases.where("a") == "gw1"
        nursery.cancel_scope.cancel()


async def test_a_node_with_another_connection_keeps_its_lease(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        leases.connected("gw1")  # a replacing connection shook hands before the old one ended
        open_(leases, "gw1", "a")
        leases.disconnected("gw1")
        await trio.sleep(10 * LEASE_S)
        assert store.appended == []
        nursery.cancel_scope.cancel()


async def test_a_normal_disconnect_drops_the_will_and_a_due_one_waits_for_its_delay(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        open_(leases, "gw1", "quiet")
        open_(leases, "gw1", "lost")
        assert leases.close("gw1", "quiet", expiry_s=0, will_delay_s=None)
        closed = trio.current_time()
        assert leases.close("gw1", "lost", expiry_s=0, will_delay_s=7)
        await store.wait_for(lambda: store.appended)
        assert store.appended == [(closed + 7, "will/lost")]
        await trio.sleep(100)
        assert len(store.appended) == 1


async def test_a_session_expires_after_its_close_unless_it_resumes(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        open_(leases, "gw1", "a", expiry_s=60, with_will=False)
        open_(leases, "gw1", "b", expiry_s=60, with_will=False)
        open_(leases, "gw1", "forever", expiry_s=NEVER_EXPIRES, with_will=False)
        for client_id in ("a", "b", "forever"):
            leases.close("gw1", client_id, expiry_s=60 if client_id != "forever" else NEVER_EXPIRES,
                         will_delay_s=None)
        closed = trio.current_time()
        await trio.sleep(30)
        open_(leases, "gw1", "b", expiry_s=60, with_will=False)  # resumed in time: its expiry stops
        await store.wait_for(lambda: store.ended)
        assert store.ended == [(closed + 60, "a")]
        await trio.sleep(10 * 60)
        assert store.ended == [(closed + 60, "a")]
        assert leases.statistics().sessions_expired == 1
        nursery.cancel_scope.cancel()


async def test_the_clients_of_an_ended_lease_expire_from_its_end(autojump_clock):
    """Sessions used to expire only by their gateway's timer: a gateway that died left them forever."""
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        open_(leases, "gw1", "persistent", expiry_s=30, with_will=False)
        open_(leases, "gw1", "clean", expiry_s=0, with_will=False)
        leases.disconnected("gw1")  # the node died
        ended = trio.current_time() + LEASE_S
        await store.wait_for(lambda: len(store.ended) == 2)
        assert store.ended == [(ended, "clean"), (ended + 30, "persistent")]


async def test_connecting_to_another_node_moves_the_client_and_the_old_nodes_close_is_ignored(autojump_clock):
    """A stale copy on the first node must not expire, resume over, or end the session that moved."""
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        leases.connected("gw2")
        open_(leases, "gw1", "a", expiry_s=10, delay=30)
        open_(leases, "gw2", "a", expiry_s=10, with_will=False)
        assert store.moved == [("gw1", "a")]
        assert not leases.close("gw1", "a", expiry_s=10, will_delay_s=30)  # gw1's connection closes afterwards
        await trio.sleep(100)
        assert store.appended == [] and store.ended == []  # gw1's will was dropped; a is gw2's
        assert leases.where("a") == "gw2"
        leases.disconnected("gw1")
        await trio.sleep(100)
        assert store.appended == [] and store.ended == []
        nursery.cancel_scope.cancel()


async def test_resuming_within_the_delay_cancels_the_will_and_a_clean_start_makes_it_due_now(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        leases.connected("gw2")
        open_(leases, "gw1", "a", delay=30)
        open_(leases, "gw1", "b", delay=30)
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S + 1)
        assert leases.statistics().wills_pending == 2
        assert open_(leases, "gw2", "a", with_will=False) is None  # a resumed on gw2: its will is off
        due = open_(leases, "gw2", "b", clean_start=True)  # b started a new session: the old one's will is due
        assert due is not None and due.topic == "will/b"
        await trio.sleep(100)
        assert store.appended == []  # the caller publishes a due will
        assert leases.statistics().wills_held == 1  # b's new will, held for gw2
        nursery.cancel_scope.cancel()


async def test_a_node_back_within_its_lease_resumes_it_and_after_its_end_gets_a_new_one(autojump_clock):
    async with trio.open_nursery() as nursery:
        leases = Store().leases(nursery)
        epoch, _ = leases.connected("gw1")
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S - 1)
        assert leases.connected("gw1", epoch) == (epoch, True)
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S + 1)
        assert leases.epoch("gw1") == 0  # ended
        new_epoch, resumed = leases.connected("gw1", epoch)
        assert not resumed and new_epoch != epoch
        nursery.cancel_scope.cancel()


async def test_a_client_registered_again_after_a_reconnect_never_displaces_a_newer_connection(autojump_clock):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        leases.connected("gw1")
        leases.connected("gw2")
        open_(leases, "gw2", "a")
        leases.reattach("gw1", "a", expiry_s=0, will=will("a"), will_delay_s=0)  # gw1's older connection of a
        assert leases.where("a") == "gw2" and store.moved == [("gw1", "a")]
        leases.reattach("gw2", "b", expiry_s=0, will=will("b"), will_delay_s=0)  # a store restart forgot b
        assert leases.where("b") == "gw2"
        nursery.cancel_scope.cancel()


@pytest.fixture
def ledger(tmp_path):
    db = open_db(tmp_path / "index")
    ledger = Ledger(db)
    yield ledger
    ledger.ledger.close()
    db.close()


async def test_a_restart_rearms_expiries_and_wills_for_the_time_they_have_left(autojump_clock, ledger):
    """Timers lived in memory only: every restart made pending sessions permanent and lost delayed wills."""
    wall = now_ms()
    ledger.put("past", ClientEntry("gw1", 5, closed_ms=wall - 10_000))  # due while the store was down
    ledger.put("later", ClientEntry("gw1", 60, closed_ms=wall - 20_000))
    ledger.put("forever", ClientEntry("gw1", NEVER_EXPIRES, closed_ms=wall - 20_000))
    ledger.put("willed", ClientEntry("gw1", 3600, will("willed"), 30, closed_ms=wall - 20_000))
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery, ledger)
        start = trio.current_time()
        leases.restore(ledger.entries())
        await store.wait_for(lambda: len(store.ended) == 2 and store.appended)
        assert sorted((round(t - start), c) for t, c in store.ended) == [(0, "past"), (40, "later")]
        assert [(round(t - start), topic) for t, topic in store.appended] == [(10, "will/willed")]
        await leases.written()
        entries = ledger.entries()
        assert sorted(entries) == ["forever", "willed"]  # ended sessions leave the ledger
        assert entries["willed"].will is None  # published: a second restart must not publish it again
        nursery.cancel_scope.cancel()


async def test_a_session_resumed_before_the_restart_keeps_neither_expiry_nor_will(autojump_clock, ledger):
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery, ledger)
        leases.connected("gw1")
        open_(leases, "gw1", "a", expiry_s=60, delay=30)
        leases.close("gw1", "a", expiry_s=60, will_delay_s=30)
        open_(leases, "gw1", "a", expiry_s=60, with_will=False)  # back in time: its expiry and will are off
        leases.close("gw1", "a", expiry_s=0, will_delay_s=None)  # a clean end: the caller ends the session
        leases.session_ended("a")
        await leases.written()
        assert ledger.entries() == {}
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        store.leases(nursery, ledger).restore(ledger.entries())
        await trio.sleep(3600)
        assert store.appended == [] and store.ended == []
        nursery.cancel_scope.cancel()


async def test_clients_connected_at_the_stop_stay_with_a_node_that_adopts_its_lease_and_go_with_a_new_one(
        autojump_clock, ledger):
    """A cluster gateway that kept running keeps its clients; the embedded node (or a new process) had none."""
    before = Store()
    async with trio.open_nursery() as nursery:
        leases = before.leases(nursery, ledger)
        epoch, _ = leases.connected("gw1")
        leases.connected("local")
        open_(leases, "gw1", "kept", expiry_s=30)
        open_(leases, "gw1", "unclaimed", expiry_s=30, with_will=False)  # it leaves gw1 while the store is down
        open_(leases, "local", "gone", expiry_s=30, delay=10)
        open_(leases, "away", "orphan", expiry_s=30, with_will=False)  # its node never comes back
        await leases.written()  # the CONNACKs wait for this
        nursery.cancel_scope.cancel()  # the store stops: nothing fires
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery, ledger)
        start = trio.current_time()
        leases.restore(ledger.entries())
        assert leases.connected("gw1", epoch, adopt=True) == (epoch, True)
        leases.reattach("gw1", "kept", expiry_s=30, will=will("kept"), will_delay_s=0)  # gw1 registers it again
        leases.connected("local")  # the embedded node of the restarted process
        await store.wait_for(lambda: len(store.ended) == 3)
        assert [(round(t - start), topic) for t, topic in store.appended] == [(10, "will/gone")]
        assert sorted((round(t - start), c) for t, c in store.ended) == [
            (30, "gone"), (LEASE_S + 30, "orphan"), (LEASE_S + 30, "unclaimed")]
        await trio.sleep(3600)
        assert leases.where("kept") == "gw1" and len(store.ended) == 3
        await leases.written()
        assert sorted(ledger.entries()) == ["kept"]
        nursery.cancel_scope.cancel()


async def test_a_client_registered_again_after_a_store_restart_is_not_expired_by_a_closed_entry(autojump_clock,
                                                                                               ledger):
    """A store upgraded under a running gateway finds its connected clients' sessions without connected entries
    (store.node.open_store writes them closed at the start): the gateway's registration stops their expiry."""
    ledger.put("c", ClientEntry("", 30, closed_ms=now_ms()))
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery, ledger)
        leases.restore(ledger.entries())
        epoch, _ = leases.connected("gw1", 7, adopt=True)
        leases.reattach("gw1", "c", expiry_s=30, will=None, will_delay_s=0)
        await trio.sleep(3600)
        assert store.ended == [] and leases.where("c") == "gw1"
        await leases.written()
        assert ledger.entries()["c"].closed_ms == 0  # connected
        nursery.cancel_scope.cancel()


async def test_a_stall_of_the_store_is_not_its_nodes_silence_and_a_node_silent_after_it_loses_its_lease(autojump_clock):
    """The store's loop stops for three leases (a virtual-clock jump: no task runs meanwhile, as under SIGSTOP):
    no lease ends for it; each node has a whole lease from the store's resumption, and one that stays silent
    while the store runs loses it then."""
    store = Store()
    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery)
        nursery.start_soon(leases.stalls.run)
        await trio.testing.wait_all_tasks_blocked()  # the watchdog ticks
        leases.connected("gw1")
        open_(leases, "gw1", "a")
        epoch2, _ = leases.connected("gw2")
        open_(leases, "gw2", "b")
        leases.disconnected("gw2")  # gw2's lease would end LEASE_S from now
        autojump_clock.jump(3 * LEASE_S)  # the stall
        resumed = trio.current_time()
        assert leases.silent_for("gw1") == 0  # also before the watchdog's late tick
        await trio.testing.wait_all_tasks_blocked()  # the watchdog and gw2's overdue timer ran
        assert store.appended == [] and leases.epoch("gw2") == epoch2
        assert leases.connected("gw2", epoch2) == (epoch2, True)  # back within its lease from the resumption
        leases.disconnected("gw1")  # gw1 stays silent while the store runs
        await store.wait_for(lambda: store.appended)
        assert store.appended == [(resumed + LEASE_S, "will/a")]
        assert leases.where("b") == "gw2"
        nursery.cancel_scope.cancel()


async def test_clients_connecting_at_once_have_their_ledger_records_written_together(ledger):
    """The CONNACK of a client waits for its ledger record (``written``). Fifty clients connecting at once waited
    for the append lock in turn, each in a turn of the event loop of its own only to find its record appended by
    the first: under a subscribe storm (turns of ~10 ms) the last CONNACK came 0.5 s after the first, and its
    session's SUBSCRIBEs finished that much later (issue 31). One append takes them all; they return together."""
    store = Store()
    turns = 0

    async def count_turns():
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    async def connect(number, returned):
        open_(leases, "gw1", f"c{number}", expiry_s=60)
        await leases.written()
        returned.append(turns)

    async with trio.open_nursery() as nursery:
        leases = store.leases(nursery, ledger)
        leases.connected("gw1")
        nursery.start_soon(count_turns)
        returned: list[int] = []
        async with trio.open_nursery() as clients:
            for number in range(50):
                clients.start_soon(connect, number, returned)
        assert len(returned) == 50 and max(returned) - min(returned) <= 3, returned
        leases.close("gw1", "c7", expiry_s=60, will_delay_s=None)
        await leases.written()  # one more record, after them
        entries = ledger.entries()
        assert len(entries) == 50 and entries["c7"].closed_ms and not entries["c8"].closed_ms
        nursery.cancel_scope.cancel()
