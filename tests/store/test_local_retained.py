"""The embedded store's retained lookup for new subscriptions (``LocalStore.retained_all``), over a real store node:
the topic tree is matched on the caller's loop, the records read in a worker thread only when a filter matched."""

from __future__ import annotations

import trio

from store.api import NewMessage
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import open_store


async def test_filters_that_match_no_retained_message_are_answered_without_a_worker_thread(tmp_path):
    """A SUBSCRIBE's filters usually hold no retained message (50 sessions x 1,000 filters: none did); each lookup
    took a worker-thread hop for nothing (issue 31). With every worker thread taken, the lookup still answers."""
    async with open_store(tmp_path / "data", CommitLogConfig()) as node:
        store = LocalStore(node, "gateway")
        await store.append([NewMessage("home/kitchen/temp", b"21", qos=1, retain=True)])
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        limiter = trio.to_thread.current_default_thread_limiter()
        holders = [object() for _ in range(int(limiter.total_tokens))]
        for holder in holders:
            limiter.acquire_on_behalf_of_nowait(holder)
        try:
            found = None
            with trio.move_on_after(5):  # a guard, not a timing: before, the call waited for a thread forever
                found = await store.retained_all(["office/#", "home/+/humidity", "home/kitchen/temp/+"])
            assert found == [[], [], []]
        finally:
            for holder in holders:
                limiter.release_on_behalf_of(holder)
        found = await store.retained_all(["office/#", "home/+/temp", "home/#", "home/kitchen/temp"])
        assert [[r.payload for r in each] for each in found] == [[], [b"21"], [b"21"], [b"21"]]
        store.close()
