"""A persistent session saved by the code before positions (session blob version 1) resumes on this code over a
real socket, and is saved again in the current format, its stream keyed by (filter, log) (docs/storage.md,
"Session blobs")."""

import msgspec
import trio

from gateway.app.embedded import serve_gateway
from gateway.mqtt.packets import Connack, Connect, Disconnect, Puback, Publish
from gateway.mqtt.properties import Properties
from gateway.mqtt.session import BLOB_VERSION
from store.api import MAIN_LOG, NewMessage
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from tests.helpers.trio_mqtt import DEFAULTS, RawClient

BLOB_V1 = bytes.fromhex(
    "8ba9636c69656e745f6964a464657631a86578706972795f73cd0e10ad737562736372697074696f6e739185a666696c746572a3612f"
    "2ba57175657565a3612f2ba76f7074696f6e7384a3716f7301a86e6f5f6c6f63616cc2b372657461696e5f61735f7075626c697368"
    "6564c2af72657461696e5f68616e646c696e6700af737562736372697074696f6e5f6964c0a567726f7570c0a76f66667365747381"
    "a3612f2b01a7637572736f727381a3612f2b01ac6177616974696e675f72656c90a8696e666c6967687490ae6e6578745f7061636b"
    "65745f696401a86177616974696e6780a56c616e657380a86465746163686564c3")
"""``SessionState("dev1", 3600, (Subscription("a/+", "a/+", SubscriptionOptions(qos=1)),), {"a/+": 1}, {"a/+": 1},
detached=True)`` as commit 9cb2293's ``encode_session`` saved it (run once): dev1 disconnected having
acknowledged a/+'s first message."""


async def test_a_session_saved_before_positions_resumes_and_is_saved_again_keyed_by_filter_and_log(tmp_path):
    async with open_store(tmp_path, CommitLogConfig()) as store:  # what the store held under the code before
        assert await store.activate("a/+", "dev1") == 0
        await store.append([NewMessage("a/x", b"%d" % i, "pub", 1) for i in range(3)], durable=True)
        await store.dispatcher.wait_dispatched(store.log.log.written_offset)
        await store.sessions.save_session("dev1", BLOB_V1)
    settings = {**DEFAULTS, "node.data": str(tmp_path), "node.port": 0}
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_gateway, settings)
        client = RawClient(await trio.open_tcp_stream(host, port))
        await client.send(Connect(client_id="dev1", clean_start=False,
                                  properties=Properties(session_expiry_interval=3600)))
        with trio.fail_after(10):
            connack = await client.receive()
            assert isinstance(connack, Connack) and connack.session_present  # [MQTT-3.2.2-2]
            received = [await client.receive() for _ in range(2)]
        assert [(type(p), p.payload) for p in received] == [(Publish, b"1"), (Publish, b"2")]  # from offset 1
        for publish in received:
            await client.send(Puback(publish.packet_id))
        await client.send(Disconnect())
        await client.stream.aclose()
        nursery.cancel_scope.cancel()
    async with open_store(tmp_path, CommitLogConfig()) as store:
        saved = msgspec.msgpack.decode(await store.sessions.load_session("dev1"))
    assert saved["v"] == BLOB_VERSION and [stream[:2] for stream in saved["streams"]] == [["a/+", MAIN_LOG]]
