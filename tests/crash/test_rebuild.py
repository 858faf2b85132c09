"""The proof that RocksDB holds only derived state: delete a store's whole index and it comes back from the log.

A `lightgate store` and a `lightgate gateway` (the cluster: a back-end consumer group needs the store's RPC) run a
mixed workload: persistent MQTT 5 sessions subscribed to an exact topic, a first-level queue, a wildcard filter, a
shared subscription and the will topic, all offline while messages arrive; a QoS 2 publisher that got PUBREC and
never sent PUBREL; a subscriber holding a QoS 2 message it never acknowledged; retained messages (one deleted); a
consumer group that committed half of what it read; a client with a delayed will still connected when the store
stops. The store is stopped (SIGTERM), its index dumped (store/dump.py), deleted, the store started again (it
re-derives the index from the CommitLog at open) and stopped, the index dumped again: the dumps must be identical.
Then the store and a gateway run again and every client comes back: each subscriber receives exactly what was
published for it while it was away, in order, nothing twice [MQTT-4.6.0-5]; the QoS 2 publisher's resend (DUP=1)
is answered PUBREC and not stored again, its PUBREL gets PUBCOMP [MQTT-4.3.3-2]; the subscriber gets its
unacknowledged QoS 2 message again with DUP=1 and its packet id [MQTT-4.4.0-1]; the group resumes after its
commit; the delayed will is published once [MQTT-3.1.2-8]. A twin run keeps its index instead of deleting it and
must pass the same tests, which shows the tests themselves are right.
"""

from __future__ import annotations

import json
import queue
import shutil
import time
from dataclasses import dataclass, field

import pytest
import trio

from gateway.mqtt.packets import MQTT_5, Publish, Pubcomp, Pubrec, Pubrel
from gateway.mqtt.properties import Properties
from store.clients.consumer import Consumer
from store.dump import dump
from tests.helpers.cluster import WAIT_S, Gateway, Store, free_port
from tests.helpers.mqtt_fixtures import RawClient, check_nothing_before_sentinel, run_id, session5, subscribe5

pytestmark = pytest.mark.slow

WILL_DELAY_S = 2
LONG_S = 3600  # the Session Expiry Interval of every persistent session: none expires during the test


@dataclass
class Workload:
    """What the first run did, and what each client must get after the rebuild."""

    run: str
    root: str
    deleted: bool  # False: the twin, whose index is kept (what every client must get is the same)
    expected: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)  # client id -> (topic, payload)
    shared: list[tuple[str, bytes]] = field(default_factory=list)  # the shared subscription's, in either member
    group_rest: list[bytes] = field(default_factory=list)  # what the group had not committed
    retained: dict[str, bytes] = field(default_factory=dict)
    q2_topic: str = ""
    q2_packet_id: int = 0
    before: dict = field(default_factory=dict)  # the dump of the original index
    after: dict = field(default_factory=dict)  # the dump of the index the store derived again


SUBSCRIBERS = {"exact": "{root}/exact", "first": "{root}/#", "wild": "{root}/+/t", "will": "w{root}/+",
               "q2watch": "q{root}/exact"}
"""Persistent subscribers and their filters. The will topic and the half-done QoS 2 publisher's are under roots of
their own, each read by one test alone: the will (published a few seconds after the restart) does not race the
other subscribers' sentinels, and the QoS 2 test's barrier neither leaves a sentinel in the others' queues nor
needs another test to have read them first, so the tests pass in any order and alone."""
SHARED = ("share-a", "share-b")


def offline_sessions(port: int, run: str, root: str) -> None:
    """Every persistent subscriber subscribes, then leaves (DISCONNECT: no will, the session stays)."""
    for name, filter in SUBSCRIBERS.items():
        client, _ = session5(port, f"{name}-{run}", LONG_S)
        assert subscribe5(client, filter.format(root=root)) == [1]
        client.disconnect()
    for name in SHARED:
        client, _ = session5(port, f"{name}-{run}", LONG_S)
        assert subscribe5(client, f"$share/g{run}/{root}/sh/#") == [1]
        client.disconnect()


def publish_all(port: int, work: Workload) -> None:
    """The messages, each one recorded for the subscribers whose filters match it."""
    root, run = work.root, work.run
    publisher, _ = session5(port, f"pub-{run}", 0, clean=True)
    plan = [(f"{root}/exact", b"e%d" % i, False) for i in range(3)] + \
        [(f"{root}/a/t", b"a%d" % i, False) for i in range(2)] + [(f"{root}/b/x", b"b0", False)] + \
        [(f"{root}/sh/{i}", b"s%d" % i, False) for i in range(4)] + \
        [(f"{root}/ret/1", b"r1", True), (f"{root}/ret/2", b"r2", True), (f"{root}/ret/3", b"r3", True),
         (f"{root}/ret/3", b"", True)]
    for topic, payload, retain in plan:
        publisher.publish(topic, payload, qos=1, retain=retain)
        first = work.expected.setdefault(f"first-{run}", [])
        first.append((topic, payload))
        if topic == f"{root}/exact":
            work.expected.setdefault(f"exact-{run}", []).append((topic, payload))
        if topic.endswith("/t"):
            work.expected.setdefault(f"wild-{run}", []).append((topic, payload))
        if "/sh/" in topic:
            work.shared.append((topic, payload))
    work.retained = {f"{root}/ret/1": b"r1", f"{root}/ret/2": b"r2"}
    publisher.disconnect()


def raw_session(port: int, client_id: str) -> tuple[RawClient, bool]:
    """A raw MQTT 5 connection of a persistent session (no automatic acknowledgements): (it, Session Present)."""
    client = RawClient(port, MQTT_5)
    connack = client.connect(client_id, clean=False, properties=Properties(session_expiry_interval=LONG_S))
    return client, connack.session_present


def half_done_qos2_publisher(port: int, work: Workload) -> None:
    """A QoS 2 PUBLISH to the q2watch subscriber's topic, PUBREC received, PUBREL never sent; the connection
    drops."""
    client, _ = raw_session(port, f"q2pub-{work.run}")
    client.send(Publish(f"q{work.root}/exact", b"q2", qos=2, packet_id=7))
    assert isinstance(client.receive(), Pubrec)
    client.close()
    work.expected[f"q2watch-{work.run}"] = [(f"q{work.root}/exact", b"q2")]


def unacknowledged_qos2_subscriber(port: int, work: Workload) -> None:
    """A QoS 2 subscriber that receives a message and never answers PUBREC; the connection drops."""
    client, _ = raw_session(port, f"q2sub-{work.run}")
    work.q2_topic = f"{work.root}/q2/t"
    client.subscribe(work.q2_topic, qos=2)
    publisher, _ = session5(port, f"pub2-{work.run}", 0, clean=True)
    publisher.publish(work.q2_topic, b"held", qos=2)
    publisher.disconnect()
    held = client.receive()
    assert isinstance(held, Publish) and held.payload == b"held" and held.qos == 2, held
    work.q2_packet_id = held.packet_id
    client.close()
    work.expected[f"first-{work.run}"].append((work.q2_topic, b"held"))
    work.expected[f"wild-{work.run}"].append((work.q2_topic, b"held"))


def group_commits_half(store_port: int, mqtt_port: int, work: Workload) -> None:
    """A consumer group of a first-level queue of its own (indexed before anyone holds it: ``start="earliest"`` sees
    what came before the join) reads six messages and commits the first three."""
    publisher, _ = session5(mqtt_port, f"pubg-{work.run}", 0, clean=True)
    payloads = [b"g%d" % i for i in range(6)]
    for payload in payloads:
        publisher.publish(f"g{work.root}/1", payload, qos=1)
    publisher.disconnect()

    async def consume() -> None:
        async with Consumer.connect("127.0.0.1", store_port, group=f"g-{work.run}", filter=f"g{work.root}/#",
                                    start="earliest", auto_commit=False) as consumer:
            with trio.fail_after(WAIT_S):
                batch = await consumer.poll(max_count=3)
            assert [m.payload for m in batch] == payloads[:3]
            assert await consumer.commit(batch) == 3

    trio.run(consume)
    work.group_rest = payloads[3:]


def connected_will_client(port: int, work: Workload) -> RawClient:
    """Connected (through the gateway) when the store stops, with a will delayed ``WILL_DELAY_S``."""
    client = RawClient(port, MQTT_5)
    client.connect(f"willc-{work.run}", clean=False, will_topic=f"w{work.root}/w", will_payload=b"gone",
                   will_qos=1, will_properties=Properties(will_delay_interval=WILL_DELAY_S),
                   properties=Properties(session_expiry_interval=LONG_S))
    work.expected[f"will-{work.run}"] = [(f"w{work.root}/w", b"gone")]
    return client


@pytest.fixture(scope="module", params=["deleted", "kept"])
def rebuilt(request, tmp_path_factory):
    """Run the workload, stop, dump, delete the index (not in the twin, "kept"), start and stop the store (it derives
    the index again at open), dump: (the store's data, its port, the workload)."""
    data = tmp_path_factory.mktemp("rebuild") / "store"
    run = run_id()
    work = Workload(run, f"rb{run}", request.param == "deleted")
    store = Store(data, free_port())
    gateway = will = None
    try:
        gateway = Gateway(store.port)
        offline_sessions(gateway.port, run, work.root)
        publish_all(gateway.port, work)
        half_done_qos2_publisher(gateway.port, work)
        unacknowledged_qos2_subscriber(gateway.port, work)
        group_commits_half(store.port, gateway.port, work)
        will = connected_will_client(gateway.port, work)
        assert store.stop() == 0
    finally:
        if gateway is not None:
            gateway.stop()
        if will is not None:
            will.close()
        store.stop()
    work.before = dump(data / "index")
    if work.deleted:
        shutil.rmtree(data / "index")
    again = Store(data, store.port, "--store-lease-s", "3600")  # no lease of the gone gateway ends while it runs
    assert again.stop() == 0
    work.after = dump(data / "index")
    return data, store.port, work


def without_ids(state: dict, names) -> dict:
    """The light queues ``names`` without what depends on the order queue ids were given out."""
    return {name: {k: v for k, v in state["queues"][name].items() if k not in ("id", "referenced_by")}
            for name in names if name in state["queues"]}


def test_exact_and_first_level_queues_come_back_with_every_entry_at_its_queue_offset(rebuilt):
    _, _, work = rebuilt
    names = [name for name in work.before["queues"] if name.startswith(work.root)
             and ("+" not in name and "#" not in name or name == f"{work.root}/#")]
    assert f"{work.root}/exact" in names and f"{work.root}/#" in names
    assert work.before["queues"][f"{work.root}/#"]["max"] == len(work.expected[f"first-{work.run}"])
    assert without_ids(work.after, names) == without_ids(work.before, names)


def test_the_index_derived_again_dumps_identical(rebuilt):
    _, _, work = rebuilt
    assert json.dumps(work.after, sort_keys=True, indent=1) == json.dumps(work.before, sort_keys=True, indent=1)


def test_retained_messages_come_back(rebuilt):
    _, _, work = rebuilt
    assert work.after["families"]["retain"] == work.before["families"]["retain"]
    assert {topic: bytes.fromhex(found["payload"]) for topic, found in work.after["families"]["retain"].items()
            if topic.startswith(work.root)} == work.retained


def test_queue_ids_filters_offsets_sessions_flows_and_clients_come_back(rebuilt):
    _, _, work = rebuilt
    for part in ("next_queue_id", "filters", "offsets"):
        assert work.after[part] == work.before[part], part
    ids = [{name: queue["id"] for name, queue in state["queues"].items()} for state in (work.after, work.before)]
    assert ids[0] == ids[1]
    for family in ("sessions", "qos2", "clients"):
        assert work.after["families"].get(family) == work.before["families"].get(family), family


@pytest.fixture(scope="module")
def running(rebuilt):
    """The store (on the derived index) and a new gateway, for the clients to come back to."""
    data, port, work = rebuilt
    store = Store(data, port)
    gateway = None
    try:
        gateway = Gateway(store.port)
        yield store, gateway, work
    finally:
        if gateway is not None:
            gateway.stop()
        store.stop()


def test_a_new_subscriber_gets_the_retained_messages(running):
    _, gateway, work = running
    client, _ = session5(gateway.port, f"new-{work.run}", 0, clean=True)
    subscribe5(client, f"{work.root}/ret/#")
    got = {m.topic: m.payload for m in client.receive(len(work.retained))}
    assert got == work.retained  # the deleted one stays deleted [MQTT-3.3.1-10]
    client.disconnect()


def raw_resume(port: int, client_id: str) -> RawClient:
    client, present = raw_session(port, client_id)
    assert present, f"{client_id}: Session Present 0 after the rebuild [MQTT-3.2.2-3]"
    return client


def nothing_more(port: int, watcher, topic: str) -> None:
    """Nothing more arrives at ``watcher`` through the subscriptions ``topic`` matches (a sentinel); it leaves."""
    barrier, _ = session5(port, f"barrier-{run_id()}", 0, clean=True)
    check_nothing_before_sentinel(watcher, barrier, topic)
    watcher.disconnect()
    barrier.disconnect()


def shared_receipts(members, publisher, root: str, count: int) -> list[tuple[str, bytes]]:
    """What the members of a shared subscription receive until ``count`` messages and a sentinel published now
    arrived (the members claim shares of the backlog: no order holds across them, so the sentinel is no barrier
    here, only the last message to wait for; a message delivered twice before it shows as one too many)."""
    sentinel = (f"{root}/sh/sentinel", b"sentinel-" + run_id().encode())
    publisher.publish(*sentinel, qos=1)
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count + 1 or sentinel not in got:
        if time.monotonic() > deadline:
            pytest.fail(f"the shared subscription's members got {got}, expected {count} and {sentinel}")
        for member in members:
            try:
                message = member.messages.get(timeout=0.05)
            except queue.Empty:
                continue
            got.append((message.topic, message.payload))
    return [m for m in got if m != sentinel]


def resume(port: int, client_id: str):
    client, present = session5(port, client_id, LONG_S)
    assert present, f"{client_id}: Session Present 0 after the rebuild [MQTT-3.2.2-3]"
    return client


def test_every_persistent_subscriber_gets_exactly_what_was_published_while_it_was_away(running):
    _, gateway, work = running
    barrier, _ = session5(gateway.port, f"barrier-{work.run}", 0, clean=True)
    for name, filter in (("first", "x/y"), ("exact", "exact"), ("wild", "z/t")):  # first: the others' sentinels
        client_id = f"{name}-{work.run}"                                         # go to its queue too
        client = resume(gateway.port, client_id)
        expected = work.expected[client_id]
        assert [(m.topic, m.payload) for m in client.receive(len(expected))] == expected, client_id
        check_nothing_before_sentinel(client, barrier, f"{work.root}/{filter}")
        client.disconnect()
    members = [resume(gateway.port, f"{name}-{work.run}") for name in SHARED]
    got = shared_receipts(members, barrier, work.root, len(work.shared))
    assert sorted(got) == sorted(work.shared)  # each message of the group to one member, once
    for member in members:
        member.disconnect()
    barrier.disconnect()


def test_the_half_done_qos2_publisher_completes_and_its_resend_is_not_stored_again(running):
    _, gateway, work = running
    client = raw_resume(gateway.port, f"q2pub-{work.run}")
    client.send(Publish(f"q{work.root}/exact", b"q2", qos=2, dup=True, packet_id=7))
    assert isinstance(client.receive(), Pubrec)  # known flow: acknowledged, not stored again [MQTT-4.3.3-2]
    client.send(Pubrel(7))
    completed = client.receive()
    assert isinstance(completed, Pubcomp) and completed.packet_id == 7 and not completed.reason_code.is_failure
    client.close()
    watcher = resume(gateway.port, f"q2watch-{work.run}")
    expected = work.expected[f"q2watch-{work.run}"]
    assert [(m.topic, m.payload) for m in watcher.receive(len(expected))] == expected
    nothing_more(gateway.port, watcher, f"q{work.root}/exact")  # no second b"q2"


def test_the_subscriber_gets_its_unacknowledged_qos2_message_again(running):
    _, gateway, work = running
    client = raw_resume(gateway.port, f"q2sub-{work.run}")
    again = client.receive()
    assert isinstance(again, Publish) and again.payload == b"held", again
    assert again.dup and again.packet_id == work.q2_packet_id  # [MQTT-4.4.0-1]
    client.send(Pubrec(again.packet_id))
    assert isinstance(client.receive(), Pubrel)
    client.send(Pubcomp(again.packet_id))
    client.close()


def test_the_group_continues_from_its_committed_offsets(running):
    store, _, work = running

    async def consume() -> list[bytes]:
        async with Consumer.connect("127.0.0.1", store.port, group=f"g-{work.run}", filter=f"g{work.root}/#",
                                    start="latest", auto_commit=False) as consumer:
            with trio.fail_after(WAIT_S):
                return [m.payload for m in await consumer.poll(wait_s=0)]

    assert trio.run(consume) == work.group_rest


def test_the_delayed_will_is_published_once(running):
    _, gateway, work = running
    watcher = resume(gateway.port, f"will-{work.run}")
    [will] = watcher.receive(1)
    assert (will.topic, will.payload) == (f"w{work.root}/w", b"gone")
    nothing_more(gateway.port, watcher, f"w{work.root}/sentinel")
