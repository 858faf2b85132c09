"""A follower in its own process, for tests that SIGKILL it: ``python -m tests.helpers.replica_follower DATA PORT NAME
EPOCH SEGMENT_BYTES`` opens DATA in follower mode and follows the leader at 127.0.0.1:PORT; it writes ``following`` to
stderr once the leader welcomed it."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import trio

from store.log.commitlog import CommitLogConfig
from store.node import open_follower
from store.replica.follower import follow


async def main(data: Path, port: int, name: str, epoch: int, segment_bytes: int) -> None:
    config = CommitLogConfig(segment_bytes=segment_bytes, max_record_bytes=64 * 1024, retention_check_interval_s=0)
    async with open_follower(data, config) as (alog, dispatcher), trio.open_nursery() as nursery:
        await nursery.start(partial(follow, alog, dispatcher, ("127.0.0.1", port), name=name, epoch=epoch))
        print("following", file=sys.stderr, flush=True)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
