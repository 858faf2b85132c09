"""Store writes a full data disk refused: owed, done in order once there is room, over a real store on a real tmpfs."""

from __future__ import annotations

import functools

import pytest
import trio

from gateway.node.commits import CommitBatcher
from gateway.node.owed import OwedWrites
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.log.errors import LogFullError
from store.node import open_store
from tests.helpers.fulldisk import fill

pytestmark = pytest.mark.slow

WAIT_S = 20.0


async def until(condition) -> None:
    with trio.fail_after(WAIT_S):
        while not condition():
            await trio.sleep(0.01)


async def test_owed_writes_are_done_in_order_before_the_owners_next_write_and_by_themselves(small_disk):
    filler = small_disk / "filler"
    async with open_store(small_disk / "data", CommitLogConfig(segment_bytes=1 << 20)) as store:
        client = LocalStore(store)
        queues = store.queues
        async with trio.open_nursery() as nursery:
            owed = OwedWrites(nursery)
            await client.activate("a/+", "c")
            fill(filler)
            # An UNSUBSCRIBE's release: refused by the full disk, owed.
            assert not await owed.attempt("c", functools.partial(client.release, "a/+", "c"))
            assert queues.held_by("c") and owed.owed == 1
            # The owner's next write (a SUBSCRIBE of the same filter) must come after it: refused while full...
            with pytest.raises(LogFullError):
                await owed.settle("c")
            filler.unlink()
            # ...and once there is room, the release is done first, so the new activation stands.
            await owed.settle("c")
            await client.activate("a/+", "c")
            assert queues.held_by("c") == ["a/+"] and owed.owed == 0
            # Owed writes nobody settles are done by themselves once the disk has room.
            fill(filler)
            assert not await owed.attempt("c", functools.partial(client.release, "a/+", "c"))
            filler.unlink()
            await until(lambda: owed.owed == 0)
            assert not queues.held_by("c")
            nursery.cancel_scope.cancel()
        client.close()


async def test_an_offset_commit_the_full_disk_refused_is_written_once_there_is_room(small_disk):
    filler = small_disk / "filler"
    async with open_store(small_disk / "data", CommitLogConfig(segment_bytes=1 << 20)) as store:
        client = LocalStore(store)
        await client.activate("q", "s")
        async with trio.open_nursery() as nursery:
            batcher = CommitBatcher(client, nursery)
            fill(filler)
            batcher.post("s", {"q": 5})
            await until(lambda: batcher.owed.owed == 1)  # refused, owed
            batcher.post("s", {"q": 7})  # a newer offset of the queue wins over the refused one
            assert await client.get_offsets("s") == {}
            filler.unlink()
            await until(lambda: batcher.owed.owed == 0)
            assert await client.get_offsets("s") == {"q": 7}
            nursery.cancel_scope.cancel()
        client.close()
