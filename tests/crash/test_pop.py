"""POP consumption through SIGKILLs of a consumer process and of the `lightgate store` process.

A producer stores ``TOTAL`` messages. A consumer process (tests/helpers/pop_holder.py) pops a batch with a short
invisible time, acknowledges half and is SIGKILLed holding the rest: those come back after the invisible time, to
another member, as attempt 2. That member pops and acknowledges the rest; halfway through, the store is SIGKILLed
while the member holds a popped batch, and started again on the same data: the checkpoints and acks are derived
again from the log, so the held batch's handles still acknowledge (its invisible time has not passed). At the end:
every message acknowledged (lost: 0), none delivered again after its ack counted, and the redeliveries are the
killed consumer's messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import trio

from store.clients.pop import PopConsumer
from store.clients.producer import Producer
from tests.helpers.backend import WAIT_S
from tests.helpers.processes import ROOT, LightgateProcess

pytestmark = pytest.mark.slow

TOTAL = 200
HELD = 20
HOLDER_INVISIBLE_S = 5.0
"""The holder's invisible time: it must acknowledge half of its batch within it, one store RPC each, after its
pops (at 1 s, a stall of the holder or the store on a loaded machine would fail the acks it counts on); the
other half comes back to the test's member after it."""
HOLDER = ROOT / "tests" / "helpers" / "pop_holder.py"


async def produce(port: int) -> None:
    async with Producer.connect("127.0.0.1", port) as producer:
        for i in range(TOTAL):
            await producer.send("jobs/x", b"%d" % i, qos=1)
        await producer.flush()


def test_no_acknowledged_message_is_lost_or_delivered_again_through_consumer_and_store_kills(tmp_path):
    data = str(tmp_path / "store")
    stores = [LightgateProcess("store", "--data", data, "--listen", "127.0.0.1:0")]
    try:
        port = stores[0].ready("store node ready")
        trio.run(produce, port)
        holder = subprocess.Popen([sys.executable, str(HOLDER), str(port), "workers", "jobs/#", str(HELD), str(HOLDER_INVISIBLE_S)],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={"PYTHONPATH": str(ROOT), "PATH": ""})
        try:
            said = json.loads(holder.stdout.readline())
        finally:
            holder.kill()  # SIGKILL, holding half of its batch
            holder.wait()
        assert len(said["popped"]) == HELD and len(said["acked"]) == HELD // 2
        held = set(said["popped"]) - set(said["acked"])
        counts = trio.run(consume, port, set(said["acked"]), data, stores)
    finally:
        for store in stores:
            store.stop()
    assert counts["lost"] == 0 and counts["after_ack"] == 0
    assert counts["redelivered_payloads"] == held  # exactly the killed consumer's unacknowledged messages
    assert counts["acked_after_restart"] == counts["held_at_kill"] > 0


async def consume(port: int, acked_before: set[str], data: str, stores: list[LightgateProcess]) -> dict:
    """Pop and acknowledge everything left, SIGKILLing and restarting the store halfway with a batch held."""
    acked = set(acked_before)
    deliveries: Counter[str] = Counter()
    counts = {"after_ack": 0, "redelivered": 0, "redelivered_payloads": set()}
    restarted = False
    async with PopConsumer.connect("127.0.0.1", port, group="workers", filter="jobs/#", invisible_s=60.0,
                                   wait_s=5.0, max_count=16) as consumer:
        with trio.fail_after(4 * WAIT_S):
            while len(acked) < TOTAL:
                batch = await consumer.pop()
                for message in batch:
                    payload = message.payload.decode()
                    deliveries[payload] += 1
                    counts["after_ack"] += payload in acked
                    if message.attempt > 1:
                        counts["redelivered"] += 1
                        counts["redelivered_payloads"].add(payload)
                if batch and not restarted and len(acked) >= TOTAL // 2:
                    connects = consumer.client.client_statistics().connects
                    stores.append(await trio.to_thread.run_sync(restart, stores[0], data, port))
                    restarted = True
                    await consumer.client.wait_reconnected(connects)
                    counts["held_at_kill"] = len(batch)
                    done = await consumer.ack_all(batch)  # the batch popped before the kill: still this member's
                    counts["acked_after_restart"] = sum(done)
                    acked.update(m.payload.decode() for m, ok in zip(batch, done) if ok)
                    continue
                for message, ok in zip(batch, await consumer.ack_all(batch)):
                    if ok:
                        acked.add(message.payload.decode())
    counts["lost"] = TOTAL - len(acked)
    counts["delivered"] = sum(deliveries.values())
    print(json.dumps({k: (len(v) if isinstance(v, set) else v) for k, v in counts.items()}))
    return counts


def restart(first: LightgateProcess, data: str, port: int) -> LightgateProcess:
    """SIGKILL the store and start it again on the same data and port."""
    first.kill()
    again = LightgateProcess("store", "--data", data, "--listen", f"127.0.0.1:{port}")
    again.ready("store node ready")
    return again
