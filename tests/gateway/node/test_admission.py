"""Connection admission without sockets: the connection cap, the per-source token bucket, its bounded memory."""

import pytest

from gateway.node.admission import Admission, AdmissionCounters, Verdict, source_key
from gateway.app.config import OPTIONS

DEFAULTS = {o.key: o.default for o in OPTIONS}


def test_defaults_admit_everyone_and_count_the_open_connections():
    admission = Admission.from_config(DEFAULTS)
    assert [admission.admit("10.0.0.1", 0.0) for _ in range(1000)] == [Verdict.ADMITTED] * 1000
    assert admission.connections == 1000
    assert admission.tracked_sources() == 0  # no rate limit: no buckets kept
    admission.release()
    assert admission.connections == 999
    assert admission.counters == AdmissionCounters()


def test_the_connection_cap_refuses_until_one_closes():
    admission = Admission(max_connections=2)
    assert admission.admit("10.0.0.1", 0.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.2", 0.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.3", 0.0) is Verdict.MAX_CONNECTIONS
    assert admission.admit("10.0.0.3", 5.0) is Verdict.MAX_CONNECTIONS
    assert admission.counters == AdmissionCounters(refused_max_connections=2)
    admission.release()
    assert admission.admit("10.0.0.3", 5.0) is Verdict.ADMITTED
    assert admission.connections == 2


def test_release_without_an_admitted_connection_is_a_bug():
    with pytest.raises(RuntimeError, match="without an admitted connection"):
        Admission().release()


def test_negative_limits_are_refused():
    with pytest.raises(ValueError, match="must not be negative"):
        Admission(connect_rate=-1.0)


def test_a_source_gets_its_burst_then_its_rate():
    admission = Admission(connect_rate=2.0, connect_burst=3)
    assert [admission.admit("10.0.0.1", 100.0) for _ in range(4)] == [Verdict.ADMITTED] * 3 + [Verdict.CONNECT_RATE]
    assert admission.admit("10.0.0.1", 100.4) is Verdict.CONNECT_RATE  # 0.8 of a token so far
    assert admission.admit("10.0.0.1", 100.5) is Verdict.ADMITTED  # 1 token after 0.5 s at 2/s
    assert admission.admit("10.0.0.1", 100.5) is Verdict.CONNECT_RATE
    assert admission.admit("10.0.0.1", 200.0) is Verdict.ADMITTED  # a long pause refills to the burst, not beyond
    assert admission.admit("10.0.0.1", 200.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.1", 200.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.1", 200.0) is Verdict.CONNECT_RATE
    assert admission.counters == AdmissionCounters(refused_connect_rate=4)


def test_sources_have_separate_buckets():
    admission = Admission(connect_rate=0.1, connect_burst=1)
    assert admission.admit("10.0.0.1", 0.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.1", 0.0) is Verdict.CONNECT_RATE
    assert admission.admit("10.0.0.2", 0.0) is Verdict.ADMITTED


def test_a_burst_of_zero_still_admits_one_connect():
    admission = Admission(connect_rate=1.0, connect_burst=0)
    assert admission.admit("10.0.0.1", 0.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.1", 0.0) is Verdict.CONNECT_RATE


def test_a_refusal_by_the_cap_does_not_use_up_a_token():
    admission = Admission(max_connections=1, connect_rate=0.001, connect_burst=1)
    assert admission.admit("10.0.0.1", 0.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.2", 0.0) is Verdict.MAX_CONNECTIONS
    admission.release()
    assert admission.admit("10.0.0.2", 0.0) is Verdict.ADMITTED  # its one token was still there


def test_rate_refusals_do_not_count_as_open_connections():
    admission = Admission(connect_rate=0.001, connect_burst=1)
    admission.admit("10.0.0.1", 0.0)
    for _ in range(10):
        admission.admit("10.0.0.1", 0.0)
    assert admission.connections == 1


def test_buckets_are_bounded_and_the_least_recently_seen_is_forgotten():
    admission = Admission(connect_rate=0.001, connect_burst=1, max_sources=3)
    for n in range(1, 4):
        assert admission.admit(f"10.0.0.{n}", 0.0) is Verdict.ADMITTED
    assert admission.admit("10.0.0.1", 1.0) is Verdict.CONNECT_RATE  # seen again: now the most recent
    assert admission.admit("10.0.0.4", 2.0) is Verdict.ADMITTED  # evicts 10.0.0.2, the least recently seen
    assert admission.tracked_sources() == 3
    assert admission.admit("10.0.0.1", 3.0) is Verdict.CONNECT_RATE  # remembered
    assert admission.admit("10.0.0.2", 3.0) is Verdict.ADMITTED  # forgotten: a full bucket again


@pytest.mark.parametrize(("host", "key"), [
    ("10.1.2.3", "10.1.2.3"),
    ("::ffff:10.1.2.3", "10.1.2.3"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("/run/lightgate.sock", "/run/lightgate.sock"),
])
def test_source_keys(host, key):
    assert source_key(host) == key


def test_ipv6_addresses_of_one_64_share_a_bucket():
    admission = Admission(connect_rate=0.001, connect_burst=2)
    assert admission.admit("2001:db8::1", 0.0) is Verdict.ADMITTED
    assert admission.admit("2001:db8::2", 0.0) is Verdict.ADMITTED
    assert admission.admit("2001:db8::3", 0.0) is Verdict.CONNECT_RATE
    assert admission.admit("2001:db8:0:1::1", 0.0) is Verdict.ADMITTED  # another /64
