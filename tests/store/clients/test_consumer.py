"""Back-end consumers (store/clients/consumer.py): consumer groups over the store RPC, in-process and across processes.

The slow tests run `lightgate store` and `lightgate gateway` processes, a paho
device publishing, consumers in this process and a consumer process that is
SIGKILLed with messages it never acknowledged.
"""

import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timezone

import pytest
import trio

from store.api import group_owner
from store.clients.consumer import Consumer, start_position
from store.clients.producer import Producer
from store.rpc.access import AccessDenied, StoreAccess, Verdict
from store.rpc.server import serve_rpc
from tests.helpers.backend import WAIT_S, Device, cluster, running
from tests.helpers.processes import ROOT


class Server:
    """The store's RPC server on a fixed port, which a test can stop and start again (a store restart)."""

    def __init__(self, store, nursery, access: StoreAccess | None = None) -> None:
        self.store = store
        self.nursery = nursery
        self.access = access
        self.port = 0
        self.scope: trio.CancelScope | None = None

    async def start(self) -> None:
        async def run(task_status):
            with trio.CancelScope() as self.scope:
                await serve_rpc(self.store, "127.0.0.1", self.port, access=self.access, task_status=task_status)

        listeners = await self.nursery.start(run)
        self.port = listeners[0].socket.getsockname()[1]

    def stop(self) -> None:
        self.scope.cancel()


@pytest.fixture
async def server(store, nursery):
    server = Server(store, nursery)
    await server.start()
    return server


async def publish(port: int, topic: str, *payloads: bytes) -> None:
    async with Producer.connect("127.0.0.1", port) as producer:
        for payload in payloads:
            await producer.send(topic, payload)


async def consume(consumer: Consumer, count: int, into: list[bytes]) -> None:
    """Take batches until ``into`` holds ``count`` payloads (auto-commit acknowledges all but the last batch)."""
    with trio.fail_after(WAIT_S):
        async for batch in consumer:
            into.extend(m.payload for m in batch)
            if len(into) >= count:
                await consumer.commit(batch)
                return


def test_start_positions():
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert start_position(when) == ("time", int(when.timestamp() * 1000))
    assert start_position("latest") == ("latest", 0)
    assert start_position(7) == ("offset", 7)
    for bad in ("yesterday", -1, True, 1.5):
        with pytest.raises(ValueError, match="start"):
            start_position(bad)


async def test_two_consumers_of_a_group_share_the_messages_and_each_gets_each_once(server, nursery):
    await publish(server.port, "tele/dev1/temp", *[b"%d" % i for i in range(200)])
    got_a: list[bytes] = []
    got_b: list[bytes] = []
    async with Consumer.connect("127.0.0.1", server.port, group="g", filter="tele", max_count=20) as a, \
            Consumer.connect("127.0.0.1", server.port, group="g", filter="tele/#", max_count=20) as b:
        assert a.filter == "tele/#"  # a first-level topic reads its queue

        async def until_all() -> None:
            async with trio.open_nursery() as both:
                done = trio.Event()

                acked = [0]

                async def run(consumer, into):
                    with trio.fail_after(WAIT_S):
                        async for batch in consumer:
                            into.extend(m.payload for m in batch)
                            await consumer.commit(batch)
                            acked[0] += len(batch)
                            if acked[0] >= 200:
                                done.set()

                both.start_soon(run, a, got_a)
                both.start_soon(run, b, got_b)
                await done.wait()
                both.cancel_scope.cancel()

        await until_all()
        assert got_a and got_b
        assert sorted(got_a + got_b, key=int) == [b"%d" % i for i in range(200)]
        assert a.committed == 200 or b.committed == 200
    await server.store.caught_up()  # an acknowledgement is stored on return, applied by dispatch's next step
    assert server.store.queues.get_offsets(group_owner("g")) == {"tele/#": 200}


async def test_a_new_group_starts_where_it_is_told_and_an_existing_one_resumes(server):
    await publish(server.port, "tele/dev1/temp", b"old")
    middle = datetime.now(timezone.utc)
    with trio.fail_after(WAIT_S):
        while datetime.now(timezone.utc) <= middle:  # store times are ms: the next message is stored after `middle`
            await trio.sleep(0.001)
    await publish(server.port, "tele/dev1/temp", b"new")
    for start, expected in (("earliest", [b"old", b"new"]), ("latest", []), (1, [b"new"]), (middle, [b"new"])):
        async with Consumer.connect("127.0.0.1", server.port, group=f"g-{start}", filter="tele/#",
                                    start=start) as consumer:
            batch = await consumer.poll(wait_s=0)
            assert [m.payload for m in batch] == expected, start
            await consumer.commit(batch)
    await publish(server.port, "tele/dev1/temp", b"after")
    async with Consumer.connect("127.0.0.1", server.port, group="g-earliest", filter="tele/#",
                                start="latest") as consumer:
        assert [m.payload for m in await consumer.poll(wait_s=0)] == [b"after"]  # the committed offset wins


async def test_a_batch_is_a_sequence_of_its_messages_in_queue_order(server):
    await publish(server.port, "tele/dev1/temp", b"a", b"b", b"c")
    async with Consumer.connect("127.0.0.1", server.port, group="g", filter="tele/#") as consumer:
        batch = await consumer.poll(wait_s=0)
        assert (batch[0].payload, batch[-1].payload) == (b"a", b"c")
        assert [m.payload for m in batch[1:]] == [b"b", b"c"]
        assert batch[1] in batch and batch.index(batch[2]) == 2
        assert [m.payload for m in reversed(batch)] == [b"c", b"b", b"a"]
        with pytest.raises(IndexError):
            batch[3]  # noqa: B018 - the access is what is tested


async def test_a_consumer_rejoins_after_the_store_restarts_and_gets_its_unacknowledged_messages_again(server):
    await publish(server.port, "tele/dev1/temp", b"1", b"2")
    async with Consumer.connect("127.0.0.1", server.port, group="g", filter="tele/#", auto_commit=False) as consumer:
        first = await consumer.poll()
        assert [m.payload for m in first] == [b"1", b"2"]
        server.stop()  # the store goes away before the batch is acknowledged
        await server.start()
        with trio.fail_after(WAIT_S):
            again = await consumer.poll()
        assert [m.payload for m in again] == [b"1", b"2"]
        assert await consumer.commit(again) == 2


async def test_a_consumer_may_only_join_filters_its_acl_allows(store, nursery):
    def authenticate(username, password, source):
        return Verdict(True, username)

    server = Server(store, nursery, StoreAccess(token="t", authenticate=authenticate,
                                                authorize=lambda user, cid, access, topic: topic.startswith("tele/")))
    await server.start()
    with pytest.raises(AccessDenied, match="subscribe 'cmd/#'"):
        async with Consumer.connect("127.0.0.1", server.port, group="g", filter="cmd/#", username="svc"):
            pass
    async with Consumer.connect("127.0.0.1", server.port, group="g", filter="tele/#", username="svc") as consumer:
        assert consumer.committed == 0


# --- processes ------------------------------------------------------------------------------------

HOLDER = """
import json, sys, trio
from store.clients.consumer import Consumer

async def main(port, group):
    async with Consumer.connect("127.0.0.1", int(port), group=group, filter="tele/#", max_count=10,
                                auto_commit=False) as consumer:
        batch = await consumer.poll()
        while not batch:
            batch = await consumer.poll()
        print(json.dumps([m.payload.decode() for m in batch]), flush=True)
        await trio.sleep_forever()  # busy with the batch: never acknowledges it

trio.run(main, *sys.argv[1:])
"""
"""A consumer process that claims one batch, says which, and holds it unacknowledged until it is killed."""


def device_publishes(device: Device, start: int, count: int) -> list[bytes]:
    payloads = [b"%d" % i for i in range(start, start + count)]
    for payload in payloads:
        device.publish("tele/dev1/temp", payload, qos=1)
    return payloads


@pytest.mark.slow
def test_device_messages_reach_a_consumer_group_through_kills_and_a_store_restart(tmp_path):
    with cluster(tmp_path) as (store, store_port, gateway, mqtt_port):
        device = Device(mqtt_port, "dev1")
        sent = device_publishes(device, 0, 100)

        async def two_consumers_share() -> None:
            got_a: list[bytes] = []
            got_b: list[bytes] = []
            async with Consumer.connect("127.0.0.1", store_port, group="g", filter="tele/#", max_count=10) as a, \
                    Consumer.connect("127.0.0.1", store_port, group="g", filter="tele/#", max_count=10) as b:
                async with trio.open_nursery() as both:
                    both.start_soon(consume, a, 1, got_a)
                    both.start_soon(consume, b, 1, got_b)
                rest: list[bytes] = []
                await consume(a, 100 - len(got_a) - len(got_b), rest)
            assert got_a and got_b  # both had work
            assert sorted(got_a + got_b + rest, key=int) == sent  # each message once across the two

        trio.run(two_consumers_share)

        more = device_publishes(device, 100, 50)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store_port), "g"], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            held = [p.encode() for p in json.loads(holder.stdout.readline())]
            assert len(held) == 10 and set(held) <= set(more)

            async def take_over() -> list[bytes]:
                got: list[bytes] = []
                async with Consumer.connect("127.0.0.1", store_port, group="g", filter="tele/#") as c:
                    await consume(c, 40, got)  # everything but what the holder holds
                    assert not set(got) & set(held)
                    holder.send_signal(signal.SIGKILL)  # mid-batch: its messages go to this consumer
                    await consume(c, 50, got)
                return got

            got = trio.run(take_over)
        finally:
            holder.kill()
            holder.wait()
        assert sorted(got, key=int) == more

        store.stop()  # a store restart: the group's committed offset is durable
        with running("store", "--data", str(tmp_path / "store"), "--listen", f"127.0.0.1:{store_port}") as again:
            again.ready("store node ready")
            gateway.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect"))
            last = device_publishes(device, 150, 20)

            async def resume() -> list[bytes]:
                got: list[bytes] = []
                async with Consumer.connect("127.0.0.1", store_port, group="g", filter="tele/#") as c:
                    await consume(c, 20, got)
                    assert not await c.poll(wait_s=0)  # nothing more: nothing lost, nothing delivered twice
                return got

            assert sorted(trio.run(resume), key=int) == last
        device.close()
