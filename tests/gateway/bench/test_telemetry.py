"""gateway/bench/telemetry.py: random walks stay in bounds, payloads round-trip, templates and their filters."""

import random

import orjson
import pytest

from gateway.bench.telemetry import (
    METRICS, Metric, RandomWalk, Stamp, TemplateError, TopicTemplate, decode_stamp, encode_payload, metrics_by_name,
    next_interval,
)


def test_random_walks_stay_in_bounds_and_move():
    metrics = metrics_by_name(["temperature", "battery", "humidity"])
    walk = RandomWalk(metrics)
    rng = random.Random(7)
    seen = [walk.step(rng) for _ in range(20_000)]
    for m in metrics:
        values = [s[m.name] for s in seen]
        assert m.low <= min(values) and max(values) <= m.high, m.name
        assert len(set(values)) > 100, f"{m.name} does not move"


def test_a_walk_pushed_against_a_bound_is_reflected_inside():
    steep = Metric("x", 0.5, 0.0, 1.0, step=5.0, drift=3.0)  # every step jumps several spans
    walk = RandomWalk([steep])
    rng = random.Random(1)
    values = [walk.step(rng)["x"] for _ in range(5_000)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert 0.0 < sum(values) / len(values) < 1.0 and len(set(values)) > 50  # not stuck at a bound


def test_battery_drains_on_average():
    walk = RandomWalk(metrics_by_name(["battery"]))
    rng = random.Random(3)
    last = [walk.step(rng)["battery"] for _ in range(3_000)][-1]
    assert last < METRICS["battery"].start - 10


def test_same_seed_same_readings():
    a, b = RandomWalk(metrics_by_name(["co2"])), RandomWalk(metrics_by_name(["co2"]))
    ra, rb = random.Random(5), random.Random(5)
    assert [a.step(ra) for _ in range(50)] == [b.step(rb) for _ in range(50)]


def test_unknown_or_repeated_metrics_are_refused_with_the_known_names():
    with pytest.raises(ValueError, match="unknown metric.*wind.*choose from temperature"):
        metrics_by_name(["temperature", "wind"])
    with pytest.raises(ValueError, match="twice"):
        metrics_by_name(["battery", "battery"])
    with pytest.raises(ValueError, match="none given"):
        metrics_by_name([])


def test_payload_carries_device_seq_times_and_metrics_flat():
    payload = encode_payload("sim1-00007", 41, 1_767_225_600_123_456_789, {"temperature": 21.37, "humidity": 48.2})
    doc = orjson.loads(payload)
    assert doc == {"device": "sim1-00007", "seq": 41, "ts": 1_767_225_600_123, "sent_ns": 1_767_225_600_123_456_789,
                   "temperature": 21.37, "humidity": 48.2}
    assert decode_stamp(payload) == Stamp("sim1-00007", 41, 1_767_225_600_123_456_789)


@pytest.mark.parametrize("payload", [b"21.5", b"not json", b'{"device": "d"}', b'{"device": 1, "seq": 0, "sent_ns": 1}',
                                     b'{"device": "d", "seq": "0", "sent_ns": 1}', b"[1, 2]"])
def test_other_payloads_are_not_stamps(payload):
    assert decode_stamp(payload) is None


def test_intervals_follow_rate_and_jitter():
    rng = random.Random(2)
    gaps = [next_interval(4.0, 0.2, rng) for _ in range(10_000)]
    assert 0.2 <= min(gaps) and max(gaps) <= 0.3
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.01)
    assert next_interval(2.0, 0.0, rng) == 0.5


def test_templates_make_topics_and_the_filter_that_matches_them():
    per_metric = TopicTemplate.parse("tele/{device}/{metric}")
    assert per_metric.per_metric and per_metric.filter == "tele/+/+"
    assert per_metric.topic("d1", "temperature") == "tele/d1/temperature"
    one = TopicTemplate.parse("site/a/tele/{device}")
    assert not one.per_metric and one.filter == "site/a/tele/+"
    assert one.topic("d1") == "site/a/tele/d1"
    assert TopicTemplate.parse("t/dev-{device}/x").filter == "t/+/x"  # a level holding a placeholder becomes +


@pytest.mark.parametrize("text, reason", [
    ("tele/{metric}", "must contain {device}"),
    ("tele/{device}/{room}", "unknown placeholder"),
    ("tele/+/{device}", "wildcards"),
    ("$SYS/{device}", "wildcards or start with"),
    ("tele//{device}", "empty level"),
    ("tele/{device", "topic template"),
])
def test_bad_templates_are_refused_with_a_reason(text, reason):
    with pytest.raises(TemplateError, match=reason.replace("{", r"\{").replace("$", r"\$")):
        TopicTemplate.parse(text)
