"""gateway/bench/failover.py: its accounting (loss, QoS 2 duplicates, unavailability, targets) on made-up clients,
and the acknowledgement times the crashclients publishers record, against a real broker."""

import argparse

import pytest
import trio

from gateway.bench import failover, peers
from gateway.bench.crashclients import Publisher, Subscriber, message_key
from gateway.bench.failover import Fault


def _publisher(number: int, qos: int, acks: list[tuple[int, float, float]]) -> Publisher:
    """A publisher whose messages ``(seq, first sent, acknowledged)`` were acknowledged."""
    publisher = Publisher(number, qos, f"fail/{number}", rate=1.0)
    for seq, sent, acked in acks:
        publisher.acked.add(message_key(number, seq))
        publisher.ack_times.append((sent, acked))
    return publisher


def _subscriber(number: int, qos: int, counts: dict[tuple[int, int], int]) -> Subscriber:
    subscriber = Subscriber(number, qos, "fail/#")
    subscriber.counts = {message_key(*key): n for key, n in counts.items()}
    return subscriber


def test_unavailability_ends_at_the_first_ack_of_a_message_sent_after_the_fault():
    # Publisher 0's seq 1 was sent before the fault at t=10 and acknowledged after it (the new leader took its
    # resend, or the old one had stored it): it says nothing of when publishing resumed. Seq 2 and publisher 1's
    # seq 0 were sent after it; the earlier of their acknowledgements ends the outage.
    publishers = [_publisher(0, 1, [(0, 9.0, 9.1), (1, 9.9, 10.2), (2, 10.5, 13.25)]),
                  _publisher(1, 2, [(0, 10.1, 12.5), (1, 12.6, 12.7)])]
    assert failover.unavailable_s(publishers, 10.0) == 2.5
    assert failover.unavailable_s(publishers, 10.3) == 2.4  # publisher 1's seq 1: the first acknowledged
    assert failover.unavailable_s(publishers, 12.65) is None  # nothing sent after it was acknowledged


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert [failover.percentile(values, s) for s in (0.5, 0.99, 1.0)] == [50.0, 99.0, 100.0]
    assert [failover.percentile([3.0, 1.0, 2.0], s) for s in (0.5, 0.99, 1.0)] == [2.0, 3.0, 3.0]
    assert failover.percentile([4.0], 0.99) == 4.0


def test_account_counts_what_a_subscriber_missed_and_qos2_duplicates_only_of_qos2_publishers():
    qos1 = _publisher(0, 1, [(0, 0, 1), (1, 0, 1), (2, 0, 1)])
    qos2 = _publisher(1, 2, [(0, 0, 1), (1, 0, 1)])
    # the QoS 2 subscriber got QoS 1 messages twice (allowed: they came at QoS 1) and (1, 1) twice (not allowed);
    # the QoS 1 subscriber missed (0, 2); (1, 5) was never acknowledged: delivered, not lost
    exact = _subscriber(0, 2, {(0, 0): 2, (0, 1): 1, (0, 2): 1, (1, 0): 1, (1, 1): 2, (1, 5): 1})
    once = _subscriber(1, 1, {(0, 0): 1, (0, 1): 3, (1, 0): 1, (1, 1): 1})
    faults = [Fault("kill", "r0", 1, 5.0, 1.2, "r1", 2, 3.0, 1.5), Fault("kill", "r1", 2, 9.0, 0.3, "r2", 3, 2.0, 0.5),
              Fault("freeze", "r2", 3, 20.0, 2.2, "r0", 4, 8.0, 2.5)]
    result = failover.account([qos1, qos2], exact, once, faults)
    assert (result["acked"], result["acked_lost"], result["duplicates_qos2"]) == (5, 1, 1)
    assert result["qos1_subscriber"] == {"lost": 1, "duplicates": 2}
    assert result["qos2_subscriber"]["lost"] == 0 and result["qos2_subscriber"]["duplicates"] == 2
    assert result["qos2_subscriber"]["unacknowledged_delivered"] == 1
    assert (result["kills"], result["freezes"], result["failovers"], result["never_available"]) == (2, 1, 3, 0)
    assert (result["unavailable_s_p50"], result["unavailable_s_p99"], result["unavailable_s_max"]) == (1.5, 2.5, 2.5)
    assert result["faults"][2] == {"kind": "freeze", "replica": "r2", "epoch": 3, "elected_s": 2.2,
                                   "leader_after": "r0", "epoch_after": 4, "whole_s": 8.0, "unavailable_s": 2.5}


def test_a_fault_publishing_never_recovered_from_fails_the_unavailability_target():
    publishers = [_publisher(0, 2, [(0, 0, 1)])]
    everything = _subscriber(0, 2, {(0, 0): 1})
    faults = [Fault("kill", "r0", 1, 5.0, 1.0, "r1", 2, 3.0, 0.2), Fault("kill", "r1", 2, 9.0)]
    result = failover.account(publishers, everything, everything, faults)
    assert result["failovers"] == 1 and result["never_available"] == 1
    assert result["unavailable_s_p50"] == 0.2 and result["unavailable_s_p99"] is None
    result["throughput"] = {"ratios": {"delivered_per_s": {"quorum/unreplicated": 0.75, "leader/unreplicated": 0.8,
                                                           "all/unreplicated": 0.5}}}
    targets = failover.targets(result)
    assert targets["acked_lost"]["met"] and targets["duplicates_qos2"]["met"]
    assert not targets["unavailable_s_p99"]["met"]
    assert targets["quorum/unreplicated"] == {"value": 0.75, "target": ">= 0.7", "met": True}
    assert targets["leader/unreplicated"] == {"value": 0.8, "target": ">= 0.9", "met": False}


def test_without_faults_the_run_is_the_throughput_part_and_its_targets_alone():
    parser = argparse.ArgumentParser()
    failover.add_arguments(parser)
    result = failover.run(parser.parse_args(["--kills", "0", "--freezes", "0", "--runs", "0"]))
    assert "acked" not in result and result["throughput"] == {}  # no group was faulted, no fan-in measured
    result["throughput"] = {"ratios": {"delivered_per_s": {"quorum/unreplicated": 0.75, "leader/unreplicated": 0.92}}}
    assert failover.targets(result) == {"quorum/unreplicated": {"value": 0.75, "target": ">= 0.7", "met": True},
                                        "leader/unreplicated": {"value": 0.92, "target": ">= 0.9", "met": True}}


def test_without_etcd_the_bench_says_why_it_skipped(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no etcd on the PATH: what a machine without etcd-server looks like
    parser = argparse.ArgumentParser()
    failover.add_arguments(parser)
    result = failover.run(parser.parse_args(["--kills", "1"]))
    assert result["skipped"].startswith("etcd is not installed") and result["settings"]["kills"] == 1


def test_the_kept_directory_must_be_new_or_empty(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    failover.add_arguments(parser)
    assert parser.parse_args(["--workdir", str(tmp_path / "new")]).workdir == tmp_path / "new"
    assert parser.parse_args(["--workdir", str(tmp_path)]).workdir == tmp_path
    (tmp_path / "r0.log").write_text("an earlier run")
    with pytest.raises(SystemExit):
        parser.parse_args(["--workdir", str(tmp_path)])
    assert f"{tmp_path} is not a new or empty directory" in capsys.readouterr().err


@pytest.mark.slow
def test_publishers_record_when_each_acknowledged_message_was_sent_and_acknowledged(tmp_path):
    async def publish(broker: peers.Broker) -> list[Publisher]:
        publishers = [Publisher(qos, qos, f"fail/{qos}", rate=200.0) for qos in (1, 2)]
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            for publisher in publishers:
                nursery.start_soon(publisher.run, lambda: (broker.host, broker.port), stop)
            while min(len(p.acked) for p in publishers) < 50:
                await trio.sleep(0.01)  # polling the publishers' counters
            stop.set()
        return publishers

    with peers.start("lightgate", tmp_path) as broker:
        publishers = trio.run(publish, broker)
    for publisher in publishers:
        assert not publisher.inflight and len(publisher.ack_times) == len(publisher.acked) == publisher.seq >= 50
        assert all(sent <= acked for sent, acked in publisher.ack_times)
        assert len({sent for sent, _ in publisher.ack_times}) > 1  # the time of each message's own first PUBLISH
