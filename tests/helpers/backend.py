"""Back-end producers and consumers against real `lightgate store` and `lightgate gateway` processes: devices, runs."""

import queue
from contextlib import contextmanager
from pathlib import Path

import paho.mqtt.client as mqtt

from tests.helpers.processes import LightgateProcess

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for


@contextmanager
def running(*args: str):
    proc = LightgateProcess(*args)
    try:
        yield proc
    finally:
        proc.stop()


@contextmanager
def cluster(data: Path, *flags: str, store_port: int = 0):
    """A store process and a gateway process in front of it; yields (store, store port, gateway, MQTT port)."""
    with running("store", "--data", str(data / "store"), "--listen", f"127.0.0.1:{store_port}", *flags) as store:
        port = store.ready("store node ready")
        with running("gateway", "--store", f"127.0.0.1:{port}", "--port", "0", *flags) as gateway:
            yield store, port, gateway, gateway.ready("gateway node ready")


class Device:
    """A paho MQTT 5 client whose received messages land in a queue."""

    def __init__(self, port: int, client_id: str, username: str | None = None, password: str | None = None):
        self.messages: queue.Queue = queue.Queue()
        connacks: queue.Queue = queue.Queue()
        self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if username is not None:
            self.paho.username_pw_set(username, password)
        self.paho.on_message = lambda c, u, msg: self.messages.put(msg)
        self.paho.on_connect = lambda c, u, flags, rc, props: connacks.put(rc)
        self.subacks: queue.Queue = queue.Queue()
        self.paho.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.put(rcs)
        self.paho.connect("127.0.0.1", port)
        self.paho.loop_start()
        rc = connacks.get(timeout=WAIT_S)
        assert not rc.is_failure, rc

    def subscribe(self, filter: str, qos: int = 1) -> None:
        self.paho.subscribe(filter, qos)
        [rc] = self.subacks.get(timeout=WAIT_S)
        assert not rc.is_failure, rc

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        info = self.paho.publish(topic, payload, qos)
        info.wait_for_publish(timeout=WAIT_S)
        assert info.is_published()

    def close(self) -> None:
        self.paho.disconnect()
        self.paho.loop_stop()
