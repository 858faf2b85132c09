"""``lightgate bench codec``: every operation measured, and the result says which codec build it measured."""

import argparse

from gateway.bench import codec
from gateway.mqtt import codec as mqtt_codec


def test_codec_bench_rates_every_operation_and_names_the_build():
    parser = argparse.ArgumentParser()
    codec.add_arguments(parser)
    result = codec.run(parser.parse_args(["--count", "300", "--runs", "1"]))
    assert set(result["per_s"]) == {
        "publish_decode_311_qos0", "publish_decode_5_qos1", "publish_decode_5_qos1_properties",
        "publish_encode_311_qos0", "publish_template_5_qos1", "record_new", "record_decode"}
    assert all(rate > 0 for rate in result["per_s"].values())
    assert ("gateway.mqtt.codec" in result["compiled"]) == codec.is_compiled(mqtt_codec)
    assert result["settings"] == {"count": 300, "runs": 1, "payload": 64}
