"""The node's garbage-collection policy (gateway/app/process.py, ``set_collection_policy``) with the embedded node
in this process and raw clients over real sockets."""

import gc

import trio
import trio.testing

from gateway.app.process import GC_THRESHOLDS, set_collection_policy
from gateway.mqtt.packets import MQTT_5, Connack, Connect
from tests.helpers.trio_mqtt import RawClient, embedded_node

WAIT_S = 10.0
CLIENTS = 1500
"""Each leaves about 30 objects in garbage cycles (its connection's exception and traceback): about 45,000 in
all, four times the bound the test sets."""


async def send_malformed_packet(port: int, client_id: str) -> None:
    """Connect, send a packet of the reserved type 0 and wait for the node to close the connection
    [MQTT-4.13.1-1]: the node's error path leaves a garbage cycle."""
    client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
    with trio.fail_after(WAIT_S):
        await client.send(Connect(protocol_level=MQTT_5, client_id=client_id, clean_start=True, keep_alive=0))
        assert isinstance(await client.receive(), Connack)
        await client.stream.send_all(b"\x00\x00")
        try:
            while await client.stream.receive_some(4096):
                pass
        except trio.BrokenResourceError:  # reset rather than closed: closed all the same
            pass
    await client.stream.aclose()


async def test_garbage_cycles_left_by_client_churn_are_still_collected(tmp_path):
    """With the young generation's threshold raised, the collector still runs on its own (no ``gc.collect`` here):
    what 1,500 refused clients left in cycles is freed, and the objects the collector tracks stay within three young
    thresholds of where they were (with collection off they grow by about 45,000; the young collections' survivors
    wait in the middle generation for its own collection, every tenth: a `make test` run measured 10,254, just over
    two thresholds)."""
    thresholds = gc.get_threshold()
    set_collection_policy()
    try:
        async with embedded_node(tmp_path / "data") as port:
            for index in range(20):  # the node's first-use costs (caches, the error path's imports) are not garbage
                await send_malformed_packet(port, f"warm-up-{index}")
            await trio.testing.wait_all_tasks_blocked()
            before = len(gc.get_objects())
            for index in range(CLIENTS):
                await send_malformed_packet(port, f"churn-{index}")
            await trio.testing.wait_all_tasks_blocked()
            assert len(gc.get_objects()) - before < 3 * GC_THRESHOLDS[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
