"""A store replica that does not lead, as a process: an RPC listener (store/rpc/front.py) in its refusing phase,
naming the leader given, for tests of clients that follow the leader (tests/cluster/test_follow.py).

    python -m tests.helpers.refusing_store PORT LEADER

Prints ``ready`` once it listens; its own log lines (the refusals) go to stderr, one per line.
"""

import logging
import sys

import trio

from store.rpc.front import RpcFront


async def main(port: int, leader: str) -> None:
    front = RpcFront()
    async with trio.open_nursery() as nursery:
        await nursery.start(front.refusing, lambda: leader)
        await nursery.start(front.serve, "127.0.0.1", port)
        print("ready", file=sys.stderr, flush=True)


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    trio.run(main, int(sys.argv[1]), sys.argv[2])
