"""Other MQTT implementations against `lightgate serve`: the amqtt client and the Mosquitto command-line clients."""

import asyncio
import shutil
import signal
import subprocess
import threading

import paho.mqtt.client as mqtt
import pytest
from amqtt.client import MQTTClient

from tests.helpers.mqtt_fixtures import WAIT_S, connected, check_nothing_before_sentinel, run_id

MOSQUITTO = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("mosquitto_pub", "mosquitto_sub", "stdbuf")),
    reason="mosquitto-clients (or stdbuf) is not installed and could not be: `make test-deps` installs it as root",
)


# --- amqtt (asyncio, MQTT 3.1.1) ---------------------------------------------------------


def run_amqtt(scenario, *args):
    """Run an amqtt coroutine in its own thread and event loop: amqtt is asyncio, the tests are not."""
    result: list = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(asyncio.wait_for(scenario(*args), WAIT_S)))
        except BaseException as exc:  # handed to the test thread, which re-raises it
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(WAIT_S + 5)
    assert not thread.is_alive(), "the amqtt scenario did not finish"
    if failure:
        raise failure[0]
    return result[0]


async def amqtt_pubsub(port: int, run: str) -> list[tuple[str, bytes, int]]:
    sub = MQTTClient(client_id=f"amqtt-sub-{run}", config={"auto_reconnect": False})
    pub = MQTTClient(client_id=f"amqtt-pub-{run}", config={"auto_reconnect": False})
    await sub.connect(f"mqtt://127.0.0.1:{port}/")
    await pub.connect(f"mqtt://127.0.0.1:{port}/")
    try:
        assert await sub.subscribe([(f"am{run}/+/t", 2), (f"am{run}/#", 0)]) == [2, 0]
        for qos in (0, 1, 2):
            await pub.publish(f"am{run}/d{qos}/t", f"q{qos}".encode(), qos=qos)
        got = []
        for _ in range(6):  # each message through both filters
            message = await sub.deliver_message(timeout_duration=WAIT_S)
            got.append((message.topic, bytes(message.data), message.qos))
        return got
    finally:
        await pub.disconnect()
        await sub.disconnect()


async def amqtt_receive(port: int, topic: str, ready: threading.Event, count: int) -> list[bytes]:
    client = MQTTClient(client_id=f"amqtt-{topic.replace('/', '-')}", config={"auto_reconnect": False})
    await client.connect(f"mqtt://127.0.0.1:{port}/")
    try:
        await client.subscribe([(topic, 1)])
        ready.set()
        return [bytes((await client.deliver_message(timeout_duration=WAIT_S)).data) for _ in range(count)]
    finally:
        await client.disconnect()


def test_amqtt_publishes_and_subscribes_at_every_qos(interop_node):
    run = run_id()
    got = run_amqtt(amqtt_pubsub, interop_node.port, run)
    by_filter = sorted(got)
    assert by_filter == sorted(
        [(f"am{run}/d{q}/t", f"q{q}".encode(), q) for q in (0, 1, 2)]  # '+' filter granted QoS 2
        + [(f"am{run}/d{q}/t", f"q{q}".encode(), 0) for q in (0, 1, 2)]  # '#' filter granted QoS 0
    )


def test_amqtt_receives_from_paho_5(interop_node):
    run = run_id()
    ready = threading.Event()
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        run_amqtt(amqtt_receive, interop_node.port, f"mix{run}/x", ready, 3)))
    thread.start()
    try:
        assert ready.wait(WAIT_S)
        with connected(interop_node.port, protocol=mqtt.MQTTv5) as pub:
            for i in range(3):
                pub.publish(f"mix{run}/x", str(i).encode(), 1)
    finally:
        thread.join(WAIT_S + 10)
    assert result == [[b"0", b"1", b"2"]]


# --- mosquitto_pub / mosquitto_sub --------------------------------------------------------


class MosquittoSub:
    """A mosquitto_sub process whose stdout is read line by line; ``wait_subscribed`` waits for its SUBACK."""

    def __init__(self, port: int, *args: str) -> None:
        self.proc = subprocess.Popen(  # stdbuf: mosquitto_sub's debug lines are block-buffered on a pipe
            ["stdbuf", "-oL", "mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-d", "-F", "MSG %t %q %p", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []

    def _next_line(self) -> str:
        line = self.proc.stdout.readline()  # mosquitto_sub -W bounds the wait
        if not line:
            pytest.fail(f"mosquitto_sub ended: {self.lines}")
        self.lines.append(line.rstrip("\n"))
        return self.lines[-1]

    def wait_subscribed(self) -> None:
        while "received SUBACK" not in self._next_line():
            pass

    def messages(self, count: int) -> list[str]:
        got = []
        while len(got) < count:
            line = self._next_line()
            if line.startswith("MSG "):
                got.append(line[4:])
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def mosquitto_pub(port: int, *args: str) -> None:
    done = subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), *args],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr


@MOSQUITTO
@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_clients_wildcard_pubsub_at_every_qos(interop_node, version):
    run = run_id()
    sub = MosquittoSub(interop_node.port, "-V", version, "-t", f"mq{run}/+/temp", "-q", "2", "-C", "3",
                       "-W", str(int(WAIT_S)))
    try:
        sub.wait_subscribed()
        for qos in (0, 1, 2):
            mosquitto_pub(interop_node.port, "-V", version, "-t", f"mq{run}/dev{qos}/temp", "-q", str(qos),
                          "-m", f"t{qos}")
        mosquitto_pub(interop_node.port, "-V", version, "-t", f"mq{run}/dev0/hum", "-m", "h")
        assert sorted(sub.messages(3)) == [f"mq{run}/dev{q}/temp {q} t{q}" for q in (0, 1, 2)]
        assert sub.proc.wait(timeout=WAIT_S) == 0  # -C 3: exits after exactly three messages
    finally:
        sub.close()


@MOSQUITTO
def test_mosquitto_sub_killed_publishes_its_will_and_others_carry_on(interop_node):
    run = run_id()
    with connected(interop_node.port) as watcher:
        watcher.subscribe(f"mw{run}/#", 1)
        dying = MosquittoSub(interop_node.port, "-t", f"mw{run}/data", "--will-topic", f"mw{run}/will",
                             "--will-payload", "gone", "--will-qos", "1", "-W", str(int(WAIT_S)))
        try:
            dying.wait_subscribed()
            dying.proc.send_signal(signal.SIGKILL)  # no DISCONNECT: the will goes
            (will,) = watcher.receive(1)
            assert (will.topic, will.payload) == (f"mw{run}/will", b"gone")
        finally:
            dying.close()
        mosquitto_pub(interop_node.port, "-t", f"mw{run}/data", "-q", "1", "-m", "after")
        (msg,) = watcher.receive(1)
        assert msg.payload == b"after"
        check_nothing_before_sentinel(watcher, watcher, f"mw{run}/data")


@MOSQUITTO
def test_mosquitto_sub_persistent_session_gets_what_it_missed(interop_node):
    run = run_id()
    args = ("-V", "mqttv311", "-c", "-i", f"mqp-{run}", "-t", f"mqp{run}/#", "-q", "1", "-W", str(int(WAIT_S)))
    first = MosquittoSub(interop_node.port, *args, "-C", "1")
    try:
        first.wait_subscribed()
        mosquitto_pub(interop_node.port, "-t", f"mqp{run}/a", "-q", "1", "-m", "online")
        assert first.messages(1) == [f"mqp{run}/a 1 online"]
        assert first.proc.wait(timeout=WAIT_S) == 0
    finally:
        first.close()
    for i in range(2):
        mosquitto_pub(interop_node.port, "-t", f"mqp{run}/a", "-q", "1", "-m", f"offline{i}")
    again = MosquittoSub(interop_node.port, *args, "-C", "2")
    try:
        assert again.messages(2) == [f"mqp{run}/a 1 offline0", f"mqp{run}/a 1 offline1"]
    finally:
        again.close()
