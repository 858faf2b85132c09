"""The etcd client (store/controller/etcd.py) against a real etcd 3.4: every call, failover, timeouts."""

import uuid

import pytest
import trio

from store.controller.etcd import Compare, Delete, EtcdClient, EtcdError, EtcdUnavailable, Put
from tests.helpers.etcd import free_port, running_etcd


def key(name: str) -> str:
    return f"/test/{uuid.uuid4().hex}/{name}"


async def test_put_get_prefix_delete(etcd):
    async with EtcdClient.open(etcd.endpoints) as client:
        base = key("")
        assert await client.get(base + "a") == (None, 0)
        revision = await client.put(base + "a", b"one")
        assert await client.get(base + "a") == (b"one", revision)
        await client.put(base + "b", b"\x00\xff binary")
        await client.put(base[:-1] + "-outside", b"x")  # shares the prefix's stem, not the prefix
        values, header_revision = await client.get_prefix(base)
        assert values == {base + "a": b"one", base + "b": b"\x00\xff binary"}
        assert header_revision >= revision + 1
        assert await client.delete(base, prefix=True) == 2
        assert (await client.get_prefix(base))[0] == {}
        assert await client.get(base[:-1] + "-outside") != (None, 0)


async def test_txn_compares_value_version_revisions_and_lease(etcd):
    async with EtcdClient.open(etcd.endpoints) as client:
        k = key("k")
        absent = [Compare(k, "create", "==", 0)]
        assert (await client.txn(absent, [Put(k, b"v1")], [Put(k + "-lost", b"x")]))[0] is True
        succeeded, responses = await client.txn(absent, [Put(k, b"v2")], [Put(k + "-lost", b"x")])
        assert succeeded is False and "response_put" in responses[0]
        assert (await client.get(k))[0] == b"v1" and (await client.get(k + "-lost"))[0] == b"x"
        _, mod = await client.get(k)
        assert (await client.txn([Compare(k, "value", "==", b"v1"), Compare(k, "version", "==", 1),
                                  Compare(k, "mod", "==", mod), Compare(k, "create", "==", mod)],
                                 [Put(k, b"v2")]))[0] is True
        assert (await client.txn([Compare(k, "value", "==", b"v1")], [Put(k, b"v3")]))[0] is False
        assert (await client.txn([Compare(k, "mod", ">", mod)], [Delete(k)]))[0] is True
        assert await client.get(k) == (None, 0)
        lease, _ = await client.lease_grant(10)
        await client.put(k, b"leased", lease)
        assert (await client.txn([Compare(k, "lease", "==", lease)], []))[0] is True
        assert (await client.txn([Compare(k, "lease", "==", lease + 1)], []))[0] is False
        await client.lease_revoke(lease)


async def test_lease_grant_keepalive_revoke(etcd):
    async with EtcdClient.open(etcd.endpoints) as client:
        k = key("member")
        lease, ttl = await client.lease_grant(5)
        assert ttl == 5
        await client.put(k, b"alive", lease)
        assert await client.lease_keepalive(lease) == 5
        await client.lease_revoke(lease)
        assert await client.get(k) == (None, 0)  # the key went with its lease
        assert await client.lease_keepalive(lease) == 0  # the lease is gone: TTL 0
        await client.lease_revoke(lease)  # revoking a lease already gone is not an error
        with pytest.raises(EtcdError, match="lease"):
            await client.put(k, b"x", lease)


async def test_watch_streams_puts_and_deletes_from_a_revision(etcd):
    async with EtcdClient.open(etcd.endpoints) as client:
        base = key("")
        first = await client.put(base + "a", b"1")
        await client.put(base + "b", b"2")
        await client.delete(base + "a")
        events = []
        watch = client.watch(base, first, prefix=True)
        async for event in watch:
            events.append((event.kind, event.key, event.value))
            if len(events) == 3:
                break
        await watch.aclose()
        assert events == [("put", base + "a", b"1"), ("put", base + "b", b"2"), ("delete", base + "a", b"")]

        start = await client.put(base + "other", b"x") + 1
        async with trio.open_nursery() as nursery:
            seen = trio.Event()
            got = []

            async def follow() -> None:
                async for event in client.watch(base + "c", start):
                    got.append(event.value)
                    seen.set()
                    return
            nursery.start_soon(follow)
            await client.put(base + "c", b"later")
            await seen.wait()
        assert got == [b"later"]


async def test_a_dead_endpoint_is_skipped_and_none_answering_says_what_was_tried(etcd):
    dead = f"http://127.0.0.1:{free_port()}"
    async with EtcdClient.open([dead, *etcd.endpoints]) as client:
        k = key("k")
        await client.put(k, b"v")
        assert (await client.get(k))[0] == b"v"
    other_dead = f"http://127.0.0.1:{free_port()}"
    async with EtcdClient.open([dead, other_dead]) as client:
        with pytest.raises(EtcdUnavailable) as raised:
            await client.get(k)
    assert dead in str(raised.value) and other_dead in str(raised.value)


@pytest.mark.slow
async def test_a_hung_etcd_costs_a_timeout_not_a_hang(tmp_path):
    """A frozen member (SIGSTOP) accepts connections and never answers: each call gives up after its timeout."""
    with running_etcd(tmp_path) as cluster:
        async with EtcdClient.open(cluster.endpoints) as client:  # the default timeout: a loaded machine's put
            await client.put("/k", b"v")
        async with EtcdClient.open(cluster.endpoints, timeout_s=0.5) as client:
            cluster.freeze(0)
            try:
                with trio.fail_after(5):
                    with pytest.raises(EtcdUnavailable, match="Timeout"):
                        await client.get("/k")
            finally:
                cluster.thaw(0)
            assert (await client.get("/k"))[0] == b"v"
