"""Offset commits of many sessions written together, over a real store."""

from pathlib import Path

import trio

from gateway.node.commits import CommitBatcher
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import open_store


async def test_concurrent_commits_share_writes_and_all_land(tmp_path: Path):
    async with open_store(tmp_path, CommitLogConfig(segment_bytes=1 << 20)) as store:
        client = LocalStore(store)
        for i in range(50):
            await client.activate(f"q/{i}", f"s{i}")
        async with trio.open_nursery() as nursery:
            batcher = CommitBatcher(client, nursery)
            for i in range(50):
                nursery.start_soon(batcher.commit, f"s{i}", {f"q/{i}": i + 1})
        assert batcher.commits == 50 and batcher.writes < 50
        for i in range(50):
            assert await client.get_offsets(f"s{i}") == {f"q/{i}": i + 1}
        await batcher.commit("s0", {"q/0": 7})  # a later commit replaces the earlier offset
        assert await client.get_offsets("s0") == {"q/0": 7}
        client.close()


async def test_posted_commits_are_written_in_order_and_forget_drops_unwritten_ones(tmp_path: Path):
    async with open_store(tmp_path, CommitLogConfig(segment_bytes=1 << 20)) as store:
        client = LocalStore(store)
        await client.activate("q", "a")
        async with trio.open_nursery() as nursery:
            batcher = CommitBatcher(client, nursery)
            for offset in range(1, 21):  # no waiting: the last post wins, however the writes are grouped
                batcher.post("a", {"q": offset})
            batcher.post("b", {"q": 5})
            await batcher.forget("b")  # dropped before any write took it
        assert await client.get_offsets("a") == {"q": 20}
        assert await client.get_offsets("b") == {}
        assert batcher.writes <= 2
        client.close()
