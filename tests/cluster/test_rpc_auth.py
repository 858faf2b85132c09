"""The store RPC port against its own users and strangers, with a real `lightgate store` and `lightgate gateway`.

- A back-end user who logs in under a gateway node's name (guessable: host and pid) gets a name in the back-end
  namespace: the gateway's connection, events and wills stay its own.
- Connections that never authenticate cost bounded memory (a frame before the Hello is capped at a few KiB, the
  store's RSS measured) and are closed at the handshake deadline, with one log line per peer address.
- A logged-in back-end user's malformed frame gets its Error frame and costs one WARNING line, every time.
"""

import socket
import time
from pathlib import Path

import msgspec
import pytest
import trio

from gateway.auth.passwords import PasswordFile
from store.api import NewMessage
from store.rpc import wire as rpc
from store.rpc.client import RemoteStore
from store.rpc.server import HANDSHAKE_TIMEOUT_S
from tests.helpers.cluster import WAIT_S, Gateway, Store, free_port, run_id
from tests.helpers.mqtt_fixtures import connected

pytestmark = pytest.mark.slow

TOKEN = "gateway-token-of-the-test"  # store.token: at least 16 characters
USER, PASSWORD = "billing", "billing-pw"

HOSTILE_CONNECTIONS = 8
JUNK_BYTES = 8 * 1024 * 1024
"""Each hostile connection announces a 64 MiB frame and sends this much of it: 64 MiB in all, buffered whole by a
store that trusts the length before authentication."""

MALFORMED_FRAMES = 90
"""Connections that each log in and send one malformed frame: enough that a race between the store's two senders
on one socket showed (17 tracebacks and 18 lost Error frames in 90)."""

RSS_GROWTH_LIMIT = 16 * 1024 * 1024
"""What the hostile connections may add to the store's resident memory: sockets and tasks, not their bytes."""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def secured_store(tmp_path: Path, *flags: str) -> Store:
    passwords = PasswordFile.load_or_empty(tmp_path / "passwd")
    passwords.set_password(USER, PASSWORD)
    passwords.save()
    return Store(tmp_path / "data", free_port(), "--store-token", TOKEN,
                 "--auth-password-file", str(tmp_path / "passwd"), *flags)


def append_as_backend(port: int, node: str, topic: str) -> None:
    """Log in as the back-end user under ``node`` and append one message (so the store admitted it)."""
    async def run() -> None:
        async with RemoteStore.connect("127.0.0.1", port, node=node, username=USER, password=PASSWORD,
                                             timeout_s=WAIT_S) as client:
            [appended] = await client.append_groups([[NewMessage(topic, b"from the back end", qos=1)]])
            assert not isinstance(appended, Exception), appended

    trio.run(run)


def test_a_back_end_user_under_a_gateway_node_name_does_not_evict_the_gateway(tmp_path):
    store = secured_store(tmp_path)
    gateway = Gateway(store.port, "--store-token", TOKEN)
    run = run_id()
    try:
        with connected(gateway.port) as sub:
            sub.subscribe(f"cmd{run}/#", 1)
            for attempt in range(3):  # repeatedly, as the attack did
                append_as_backend(store.port, gateway.node, f"cmd{run}/{attempt}")
                [message] = sub.receive(1)  # the gateway still gets its events
                assert message.payload == b"from the back end"
        assert not [doc for doc in store.logs if doc.get("msg", "").startswith("gateway node reconnected")]
        assert not [doc for doc in gateway.logs if doc.get("msg") == "connected to the store" and doc.get("reconnect")]
        after = 0
        for _ in range(3):  # the store's log lines arrive through a reader thread: wait for each
            line = store.wait_log(lambda doc: doc.get("msg") == "back-end client connected", after=after)
            assert line["node"] == f"$client/{USER}:{gateway.node}"
            after = store.logs.index(line) + 1
        assert not [doc for doc in store.logs + gateway.logs if TOKEN in str(doc)]  # in no line of either log
    finally:
        gateway.stop()
        store.stop()


def test_unauthenticated_connections_cost_bounded_memory_and_end_at_the_handshake_deadline(tmp_path):
    store = secured_store(tmp_path)
    try:
        before = rss_bytes(store.proc.pid)
        hostile = [socket.create_connection(("127.0.0.1", store.port), timeout=WAIT_S)
                   for _ in range(HOSTILE_CONNECTIONS)]
        try:
            for sock in hostile:  # a 64 MiB frame announced before any Hello, and 8 MiB of it sent
                try:
                    sock.sendall((rpc.MAX_FRAME_BYTES - 1).to_bytes(4, "big") + bytes(JUNK_BYTES))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused at the length, before the body: the store closed the connection
            grown = rss_bytes(store.proc.pid) - before  # measured while they are all still open
        finally:
            for sock in hostile:
                sock.close()
        assert grown < RSS_GROWTH_LIMIT, f"the store grew by {grown / 2**20:.1f} MiB"

        silent = [socket.create_connection(("127.0.0.1", store.port), timeout=WAIT_S)
                  for _ in range(HOSTILE_CONNECTIONS)]
        started = time.monotonic()
        try:
            for sock in silent:
                sock.sendall(b"\x00\x00")  # half a frame header, then nothing
            for sock in silent:
                decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
                while (data := sock.recv(65536)):
                    decoder.receive_data(data)
                error = decoder.next_message()
                assert type(error) is rpc.Error and "no Hello within" in error.message
            assert time.monotonic() - started >= HANDSHAKE_TIMEOUT_S - 0.5  # held until the deadline, no longer
        finally:
            for sock in silent:
                sock.close()
        refused = [doc for doc in store.logs if doc.get("msg", "").startswith("RPC connection refused")]
        assert len(refused) == 1, refused  # 16 refusals, one peer address: one line
    finally:
        store.stop()


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


MALFORMED = (
    frame(b"\xc1"),  # not msgpack
    frame(msgspec.msgpack.encode(["no-such-tag", 1])),
    frame(msgspec.msgpack.encode(["append", "not an id", [], True])),  # a field of the wrong type
)


def test_every_malformed_frame_of_a_back_end_user_gets_its_error_frame_and_one_warning(tmp_path):
    store = secured_store(tmp_path, "--store-lease-s", "600")  # no lease of theirs ends (its own line) meanwhile
    run = run_id()
    try:
        for i in range(MALFORMED_FRAMES):
            with socket.create_connection(("127.0.0.1", store.port), timeout=WAIT_S) as sock:
                hello = rpc.Hello(rpc.PROTOCOL_VERSION, f"bad{i}-{run}", username=USER, password=PASSWORD.encode())
                sock.sendall(rpc.encode(hello))
                decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
                while (welcome := decoder.next_message()) is rpc.NEED_DATA:
                    decoder.receive_data(sock.recv(65536))
                assert type(welcome) is rpc.Welcome, welcome
                # A request, then the bad frame: the store is answering while it refuses the connection.
                sock.sendall(rpc.encode(rpc.GetStatistics(1)) + MALFORMED[i % len(MALFORMED)])
                while (data := sock.recv(65536)):
                    decoder.receive_data(data)
                answers = []
                while (answer := decoder.next_message()) is not rpc.NEED_DATA:
                    answers.append(answer)
                assert answers and type(answers[-1]) is rpc.Error, answers
                assert (answers[-1].id, answers[-1].kind) == (0, rpc.ErrorKind.PROTOCOL), answers
        append_as_backend(store.port, f"good-{run}", f"after{run}")  # its line comes after every bad one's
        store.wait_log(lambda doc: doc.get("msg") == "back-end client connected" and "good-" in doc["node"])
        warnings = [doc for doc in store.logs if doc.get("level") == "warning"]
        closed = [doc for doc in warnings if doc.get("msg", "").startswith("RPC connection closed")]
        assert sorted(doc["node"] for doc in closed) == sorted(f"$client/{USER}:bad{i}-{run}"
                                                               for i in range(MALFORMED_FRAMES))
        assert len(warnings) == MALFORMED_FRAMES, warnings
        assert not store.errors(), store.errors()
        assert not [doc for doc in store.logs if "Traceback" in str(doc)]
    finally:
        store.stop()
