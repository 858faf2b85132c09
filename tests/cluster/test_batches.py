"""A paho MQTT 5 subscriber cannot tell a batch record from single records (docs/storage.md, "Batch records").

A `lightgate store` and a `lightgate gateway` process; a back-end client appends the same messages twice through
the store RPC, once as single records and once as one batch record (``append(batch=True)``), each copy under a
topic root of its own. Paho devices on the gateway receive both copies as the same PUBLISH packets: payloads,
QoS, properties forwarded unaltered [MQTT-3.3.2-17] [MQTT-3.3.2-20], in publication order [MQTT-4.6.0-6], No Local
honoured for the messages of the device's own client id [MQTT-3.8.3-3], and the batch's retained message sent to
a later subscriber (Retain Handling 0) with RETAIN set [MQTT-3.3.1-9].
"""

from __future__ import annotations

import pytest
import trio
from paho.mqtt.subscribeoptions import SubscribeOptions

from store.api import NewMessage
from store.clients.properties import encode_properties
from store.rpc.client import RemoteStore
from tests.helpers.backend import WAIT_S, Device, cluster

pytestmark = pytest.mark.slow

COUNT = 40


def messages(root: str) -> list[NewMessage]:
    """The messages of one copy: several publishers (one of them the subscriber itself), QoS 0 and 1, properties
    on some, one retained."""
    return [NewMessage(f"{root}/t", b"%d" % i, client_id="dev1" if i % 5 == 0 else f"svc{i % 3}", qos=i % 2,
                       retain=i == 7,
                       properties=encode_properties(content_type="text/plain", user_properties=[("n", str(i))])
                       if i % 4 == 0 else b"") for i in range(COUNT)]


def by_root(device: Device, count: int) -> dict[str, list[tuple]]:
    """The next ``count`` PUBLISH packets a device gets, by topic root (each root's in the order received: the two
    copies are two queues, delivered side by side), as what a subscriber sees of them besides the root."""
    found: dict[str, list[tuple]] = {"single": [], "batch": []}
    for _ in range(count):
        msg = device.messages.get(timeout=WAIT_S)
        root, rest = msg.topic.split("/", 1)
        props = msg.properties
        found[root].append((rest, msg.payload, msg.qos, msg.retain, getattr(props, "ContentType", None),
                            getattr(props, "UserProperty", None)))
    return found


def test_a_subscriber_gets_the_same_packets_for_a_batch_record_as_for_single_records(tmp_path):
    with cluster(tmp_path) as (store, store_port, gateway, mqtt_port):
        plain = Device(mqtt_port, "dev2")
        no_local = Device(mqtt_port, "dev1")
        for device in (plain, no_local):
            for root in ("single", "batch"):
                device.paho.subscribe(f"{root}/#", options=SubscribeOptions(qos=1, noLocal=device is no_local))
                [rc] = device.subacks.get(timeout=WAIT_S)
                assert not rc.is_failure, rc

        async def produce() -> None:
            async with RemoteStore.connect("127.0.0.1", store_port, node="svc", timeout_s=WAIT_S) as client:
                singles = await client.append(messages("single"))
                batch = await client.append(messages("batch"), batch=True)
                assert len(singles) == len(batch) == COUNT
                assert batch.offsets == [batch.offsets[0] + i for i in range(COUNT)]

        trio.run(produce)
        got = by_root(plain, 2 * COUNT)
        assert got["batch"] == got["single"]  # packet for packet
        assert [p[1] for p in got["single"]] == [b"%d" % i for i in range(COUNT)]
        assert got["single"][4][4:] == ("text/plain", [("n", "4")])
        assert [p[2] for p in got["single"][:3]] == [0, 1, 0]
        own = by_root(no_local, 2 * (COUNT - COUNT // 5))
        assert own["batch"] == own["single"]
        assert [int(p[1]) for p in own["single"]] == [i for i in range(COUNT) if i % 5]  # none of its own
        late = Device(mqtt_port, "dev3")
        late.subscribe("+/t", qos=1)
        retained = by_root(late, 2)
        assert retained["batch"] == retained["single"] and retained["single"][0][1:2] == (b"7",)
        assert retained["single"][0][3] is True
        for device in (plain, no_local, late):
            device.close()
        assert not store.errors() and not gateway.errors()
