"""The ``mqtt`` sink (spark_analytics.sink): rows of a DataFrame become MQTT messages that subscribers receive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from tests.helpers.cluster import Gateway
from tests.helpers.mqtt_fixtures import connected
from tests.helpers.spark_fixtures import store_node, telemetry, write_log

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_alerts_from_an_aggregate_reach_a_subscriber(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    msgs = telemetry(700, devices=7)
    write_log(tmp_path / "data", msgs)
    hottest: dict[str, float] = {}
    for m in msgs:
        device = m.topic.split("/")[1]
        hottest[device] = max(hottest.get(device, -100.0), json.loads(m.payload)["temp"])
    want = {f"alerts/{d}/hot": t for d, t in hottest.items() if t > 39.5}
    assert 0 < len(want) < 7
    with store_node(tmp_path / "data") as address:
        gateway = Gateway(int(address.rpartition(":")[2]))
        try:
            with connected(gateway.port) as subscriber:
                subscriber.subscribe("alerts/#", qos=1)
                peaks = (spark.read.format("commitlog")
                         .options(store=address, parse="telemetry", **{"telemetry.metrics": "temp"})
                         .load().groupBy("device").agg(F.max("temp").alias("temp")))
                alerts = peaks.where("temp > 39.5").select(
                    F.concat(F.lit("alerts/"), "device", F.lit("/hot")).alias("topic"),
                    F.to_json(F.struct("device", "temp")).alias("payload"), F.lit(1).alias("qos"))
                summary = peaks.agg(F.count(F.lit(1)).alias("n")).select(
                    F.lit("alerts/summary").alias("topic"), F.col("n").cast("string").alias("payload"),
                    F.lit(True).alias("retain"), F.lit(0).alias("qos"))
                alerts.write.format("mqtt").option("store", address).mode("append").save()
                summary.write.format("mqtt").option("store", address).mode("append").save()
                got = subscriber.receive(len(want) + 1)
                assert {m.topic: json.loads(m.payload)["temp"] for m in got if m.topic != "alerts/summary"} == want
                assert [(m.payload, m.qos) for m in got if m.topic == "alerts/summary"] == [(b"7", 0)]
            # a retained row is the topic's retained message: a later subscriber gets it, RETAIN set [MQTT-3.3.1-6]
            with connected(gateway.port, protocol=mqtt.MQTTv311) as late:
                late.subscribe("alerts/summary", qos=1)
                retained = late.receive(1)[0]
                assert (retained.payload, retained.retain) == (b"7", True)
            with pytest.raises(Exception, match="needs the column"):
                spark.range(3).write.format("mqtt").option("store", address).mode("append").save()
        finally:
            gateway.stop()
