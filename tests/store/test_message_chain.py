"""A gateway read round's messages as a ``MessageChain`` of its connections' parts, a ``PayloadRun`` among them (a
read's QoS 0 PUBLISHes that repeat one another): the store encodes a run part as batch records without a message
each, and every message still reads back as sent, at the position the append answered (issue 31).
"""

from pathlib import Path

import pytest
import trio

from store.api import MessageChain, NewMessage, PayloadRun, any_delayed
from store.log.commitlog import CommitLogConfig
from store.node import open_store

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)


def _run(topic: str, payloads: list[bytes], **fields) -> PayloadRun:
    return PayloadRun(NewMessage(topic, b"", "dev", born_ms=1000, **fields), payloads)


def test_a_chain_is_the_flat_sequence_of_its_parts():
    parts = [[NewMessage("a", b"1")], _run("b", [b"2", b"3"]), (), (NewMessage("c", b"4"),)]
    chain = MessageChain(parts)
    flat = [m for part in parts for m in part]
    assert len(chain) == 4 and list(chain) == flat and [chain[i] for i in range(-4, 4)] == flat + flat
    assert chain[1:3] == flat[1:3]
    with pytest.raises(IndexError):
        chain[4]
    assert not any_delayed(chain) and any_delayed(MessageChain([*parts, _run("d", [b"5"], deliver_at_ms=9)]))


async def test_a_chains_run_parts_are_batch_records_and_every_message_reads_back_as_sent(tmp_path: Path):
    big = b"x" * (CONFIG.max_record_bytes - 100)  # too large to share a batch record: the run is taken apart
    parts = [
        [NewMessage("tele/a", b"s0", "c1")],
        _run("tele/a", [b"r0", b"r1", b"r2"]),
        [NewMessage("tele/b", b"s1", "c2")],
        _run("tele/a", [b"t0", b"t1"], retain=True),  # retained messages stay records of their own
        _run("tele/b", [b"u0", big, b"u1"]),
    ]
    chain = MessageChain(parts)
    async with open_store(tmp_path, CONFIG) as node:
        positions = node.append_nowait(chain)
        assert len(positions) == len(chain) and positions == sorted(set(positions))
        assert positions[2] - positions[1] == positions[3] - positions[2] == 1  # r0-r2: one batch record
        assert positions[6] - positions[5] > 1  # t0, t1: records of their own
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        read = {r.offset: r for topic in ("tele/a", "tele/b")
                for _, r in node.read(topic, 0, max_count=100).messages}
        assert [(read[p].topic, read[p].payload, read[p].client_id, read[p].retain, read[p].born_ms)
                for p in positions] == [(m.topic, m.payload, m.client_id, m.retain, m.born_ms or read[p].store_ms)
                                        for p, m in zip(positions, chain)]
