"""Analytics over a replicated store group of real processes (etcd, three `lightgate store` replicas, a gateway,
MQTT publishers): the Spark live tail's log reader (spark_analytics/live.py) reads from a follower, never loading
the leader, and goes on from another replica when its follower is killed; the Parquet tier shared by the replicas
is written by one converter at a time, the new leader's after a leader kill, each segment once."""

from __future__ import annotations

import collections
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spark_analytics.live import LogReader, NotPublished
from store.log.record import MAGIC_EOS, CorruptRecord, check_frame, decode_record
from store.tierfiles import list_tier, open_tier
from tests.helpers.etcd import running_etcd
from tests.helpers.mqtt_fixtures import run_id
from tests.helpers.replicas import Group, publish_acked, wait_for

pytestmark = pytest.mark.slow

NAMES = ("r0", "r1", "r2")


class Tail:
    """The payloads of the log's records on ``topic``, read with one ``LogReader`` from offset 0 on."""

    def __init__(self, reader: LogReader, topic: str) -> None:
        self.reader, self.topic, self.offset, self.payloads = reader, topic, 0, []

    def read(self) -> list[bytes]:
        """Read on to the replica's published end; every payload read so far. A replica the reader moved to may not
        have published as far as the one it left (it flushes on its own schedule): then nothing more for now,
        and the caller's wait asks again."""
        while True:
            try:
                span = self.reader.read(self.offset, 1 << 20)
            except NotPublished:
                return self.payloads
            data, pos = span.data, 0
            while pos < len(data):
                try:
                    magic, size = check_frame(data, pos, len(data))
                except CorruptRecord:  # a record the read cut: read again from its start
                    break
                if size == 0:
                    break
                if magic != MAGIC_EOS:
                    record = decode_record(data, pos, span.start + pos)
                    if record.topic == self.topic:
                        self.payloads.append(record.payload)
                pos += size
            self.offset = span.start + pos
            if pos == 0:
                return self.payloads

    def has(self, acked: list[bytes]) -> bool:
        return set(acked) <= set(self.read())


def reader_lines(replica, role: str) -> list[dict]:
    return [doc for doc in replica.logs if doc.get("msg") == "log reader connected" and doc.get("role") == role]


def test_a_log_reader_given_every_replica_reads_from_a_follower_and_goes_on_when_it_is_killed(tmp_path):
    """Every acknowledged record ([MQTT-3.4.2-1] PUBACK 0) is read from a follower's copy of the log; the leader
    serves the reader no read. The follower is killed: the reader goes on, at its offset, from the other follower."""
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES)
        try:
            leader, _epoch = group.wait_leader()
            group.wait_isr(NAMES)
            gateway = group.gateway()
            try:
                topic = f"a{run_id()}/t"
                acked = publish_acked(gateway.port, topic, 30, prefix="before")
                assert len(acked) == 30
                with LogReader(group.addresses) as reader:
                    tail = Tail(reader, topic)
                    wait_for(lambda: tail.has(acked), "every acknowledged record read")
                    assert not reader.leads
                    serving = next(r for r in group.replicas.values() if r.address == reader.address)
                    assert serving.name != leader and reader_lines(serving, "follower")
                    assert tail.payloads == acked  # once each, in log order

                    serving.kill()
                    more = publish_acked(gateway.port, topic, 20, prefix="after")
                    assert len(more) == 20  # the leader and the other follower are a majority
                    wait_for(lambda: tail.has(acked + more), "the records acknowledged after the kill read")
                    other = next(r for r in group.replicas.values() if r.name not in (leader, serving.name))
                    assert (reader.address, reader.leads) == (other.address, False)
                    assert reader_lines(other, "follower")
                    assert tail.payloads == acked + more
                logs = group.replicas[leader].logs
                ended = lambda: [d for d in logs if d.get("msg") == "log reader disconnected"]  # noqa: E731
                wait_for(lambda: len(ended()) == len(reader_lines(group.replicas[leader], "leader")),
                         "the reader's connections to the leader closed")
                assert all(doc["reads"] == 0 for doc in ended())  # the leader was at most asked who it is
            finally:
                gateway.stop()
        finally:
            group.stop()


def conversions(group: Group) -> collections.Counter[int]:
    """How many times each segment base was converted to the tier, over every replica process's log."""
    return collections.Counter(doc["base"] for replica in group.replicas.values() for doc in replica.logs
                               if doc.get("msg") == "tier: segment converted")


def test_after_a_leader_kill_the_new_leader_converts_the_next_segments_each_once(tmp_path: Path):
    """All three replicas have the same ``tier.uri``: the leader converts its sealed segments; killed, the new
    leader converts the next ones; no segment is ever converted twice, and every tier file is whole."""
    tier = tmp_path / "tier"
    flags = ("--commitlog-segment-bytes", str(1 << 20), "--tier-uri", str(tier), "--tier-check-interval-s", "0.2",
             "--tier-cpu-share", "1")
    payload = b"x" * 32 * 1024  # ~30 records per segment
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES, *flags)
        try:
            old, epoch = group.wait_leader()
            group.wait_isr(NAMES)
            gateway = group.gateway()
            try:
                topic = f"tier{run_id()}"
                assert len(publish_acked(gateway.port, topic, 80, prefix="old", payload=payload)) == 80
                wait_for(lambda: len(conversions(group)) >= 2, "the first leader's conversions")
                by_old = set(conversions(group))
                group.replicas[old].kill()
                new, _ = group.wait_leader(after_epoch=epoch)
                gateway.wait_log(lambda doc: doc.get("msg") == "connected to the store"
                                 and doc.get("store") == group.replicas[new].address)
                assert len(publish_acked(gateway.port, topic, 80, prefix="new", payload=payload)) == 80
                by_new = lambda: {doc["base"] for doc in group.replicas[new].logs  # noqa: E731
                                  if doc.get("msg") == "tier: segment converted"}
                wait_for(lambda: len(by_new() - by_old) >= 2, "the new leader's conversions")
            finally:
                gateway.stop()
            done = conversions(group)
            assert all(count == 1 for count in done.values()), done
            assert {doc.get("msg") for r in group.replicas.values() for doc in r.logs
                    if doc.get("base") in done and r.name not in (old, new)} <= {None}  # the follower converts none
            files = list_tier(*open_tier(str(tier)))
            bases = [f.base for f in files]
            assert set(done) <= set(bases) and bases == sorted(bases)
            for tier_file in files:  # whole files: their footer reads, their rows are the segment's records
                assert pq.read_metadata(tier_file.path).num_rows > 0
        finally:
            group.stop()
