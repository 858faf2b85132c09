"""The publish-rate token bucket: refill, burst, debt, and time passed in."""

from __future__ import annotations

import pytest

from gateway.mqtt.ratelimit import TokenBucket


def test_starts_full_and_refuses_once_the_burst_is_spent():
    bucket = TokenBucket(rate=2, burst=3, now=0.0)
    assert [bucket.take(1, 0.0) for _ in range(4)] == [True, True, True, False]


def test_refills_at_the_rate_up_to_the_burst():
    bucket = TokenBucket(rate=2, burst=3, now=0.0)
    for _ in range(3):
        bucket.take(1, 0.0)
    assert bucket.tokens(0.5) == pytest.approx(1.0)
    assert bucket.take(1, 0.5) and not bucket.take(1, 0.5)
    assert bucket.tokens(100.0) == 3.0  # a long pause banks no more than the burst


def test_refused_requests_are_charged_into_debt():
    bucket = TokenBucket(rate=1, burst=1, now=0.0)
    assert bucket.take(1, 0.0)
    for _ in range(5):
        assert not bucket.take(1, 0.0)
    assert bucket.tokens(0.0) == -5.0 and bucket.debt_s(0.0) == 5.0
    assert not bucket.take(1, 5.5)  # still below the cost after 5.5 s of refill
    assert bucket.debt_s(5.5) == pytest.approx(0.5)
    assert bucket.take(1, 7.5)  # a client that slows down is served again
    assert bucket.debt_s(100.0) == 0.0


def test_a_request_larger_than_the_burst_needs_a_full_bucket():
    bucket = TokenBucket(rate=100, burst=100, now=0.0)
    assert bucket.take(250, 0.0)  # full: accepted, and it leaves a debt of 150
    assert bucket.debt_s(0.0) == pytest.approx(1.5)
    assert not bucket.take(250, 2.0)  # 50 tokens: not full
    assert bucket.take(250, 7.0)


def test_time_going_backwards_adds_nothing():
    bucket = TokenBucket(rate=10, burst=1, now=5.0)
    assert bucket.take(1, 5.0)
    assert not bucket.take(1, 4.0)
    assert bucket.tokens(4.0) == -1.0


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (1, 0), (-1, 5)])
def test_rate_and_burst_must_be_positive(rate, burst):
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(rate, burst, 0.0)
