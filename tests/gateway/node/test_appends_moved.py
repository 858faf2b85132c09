"""A connection's QoS 2 appends that the store refuses because their client is another node's now (gateway/node/
appends.py) against a real RPC server and store in this process, over real sockets.

Found by ``lightgate bench failover`` (tests/cluster/test_replication.py): a closing connection's appends reached
the new leader after its publisher had resent them on the other gateway; the store refused the batch (``LeaseLost``:
the client was present there), the node retried it message by message, and the retries met the client after its
new connection had ended (present nowhere, so not refused): the messages it had already completed there were stored
again and delivered twice ([MQTT-4.3.3-2]).
"""

import pytest
import trio

from gateway.mqtt.actions import Append, Appended
from gateway.mqtt.reasons import ReasonCode
from gateway.node.appends import Appends
from gateway.node.order import ReadOrder
from store.api import NewMessage
from store.rpc.client import RemoteStore
from store.rpc.server import serve_rpc
from tests.helpers.ports import free_port


class Answers:
    """What the node answers a connection (``Connection.feed_all``)."""

    def __init__(self) -> None:
        self.events: list[Appended] = []

    def feed_all(self, events) -> None:
        self.events.extend(events)


@pytest.fixture
async def port(store_small_records, nursery):
    port = free_port()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        await serve_rpc(store_small_records, "127.0.0.1", port, task_status=task_status)

    await nursery.start(run)
    return port


def appends_requests(remote: RemoteStore) -> int:
    return remote.client_statistics().batches.get("append", (0, 0))[1]


async def test_a_batch_refused_because_its_client_moved_is_refused_whole_and_not_retried_message_by_message(port):
    async with RemoteStore.connect("127.0.0.1", port, node="gw-a") as a, \
            RemoteStore.connect("127.0.0.1", port, node="gw-b") as b:
        await a.open_session("dev1", clean_start=False, expiry_s=60)
        await b.open_session("dev1", clean_start=False, expiry_s=60)  # the publisher connected to gw-b since
        late = [Append(ref, (NewMessage("q2/dev1", b"m%d" % ref, "dev1", 2, packet_id=ref),)) for ref in (7, 8, 9)]
        answers = Answers()
        before = appends_requests(a)
        await Appends(a, ReadOrder()).perform(answers, late)
        assert [(e.ref, e.ok, e.reason) for e in answers.events] == \
            [(ref, False, ReasonCode.SESSION_TAKEN_OVER) for ref in (7, 8, 9)]
        # One request: a retry per message could meet dev1 once it left gw-b, present nowhere, and be stored.
        assert appends_requests(a) - before == 1
