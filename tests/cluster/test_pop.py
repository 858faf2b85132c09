"""POP groups across processes: a `lightgate store` and `lightgate gateway`s. The store's POP figures reach a
gateway's /metrics (docs/operations.md, "Metrics")."""

import pytest
import trio

from store.api import NewMessage
from tests.helpers.admin import admin_port
from tests.helpers.cluster import WAIT_S, ask_store, run_id, running_cluster, wait_for
from tests.helpers.prometheus import metric

pytestmark = pytest.mark.slow

POP_METRICS = ("groups", "inflight", "waiting", "popped_total", "acked_total", "revived_total",
               "dead_lettered_total")


def pop_figures(port: int) -> tuple[float, ...]:
    return tuple(metric(port, f"lightgate_pop_{name}") for name in POP_METRICS)


def test_a_gateway_exports_its_stores_pop_figures(tmp_path):
    """Three messages popped (invisible 30 s, two attempts at most): the first acknowledged, the others given back
    at once (revived), popped again as attempt 2; the second acknowledged, the third given back again: dead-lettered.
    A change of invisible time is not a pop."""
    with running_cluster(tmp_path, 1) as (store, (gateway,)):
        port = admin_port(gateway)
        run = run_id()
        group, queue = f"workers{run}", f"jobs{run}/#"

        async def pop(client, count: int) -> list:
            popped: list = []
            with trio.fail_after(WAIT_S):
                while len(popped) < count:
                    popped += await client.pop(group, queue, "m", count - len(popped), invisible_s=30.0,
                                               wait_s=WAIT_S, max_attempts=2, start="earliest")
            return popped

        async def hand_out(client) -> list:
            await client.append([NewMessage(f"jobs{run}/a", b"%d" % i, "dev-1", 1) for i in range(3)])
            return await pop(client, 3)

        popped = ask_store(store.port, hand_out)
        assert pop_figures(port) == (1, 3, 0, 3, 0, 0, 0)

        async def settle_first(client) -> None:
            longer = await client.change_invisible(popped[0].handle, 60.0)  # not a pop
            assert await client.pop_ack([longer]) == [True]
            for message in popped[1:]:
                assert await client.change_invisible(message.handle, 0.0) is not None  # given back: revived

        ask_store(store.port, settle_first)
        wait_for(lambda: pop_figures(port) == (1, 0, 2, 3, 1, 2, 0), "the two given back to be revived")

        async def second_round(client) -> None:
            again = await pop(client, 2)
            assert sorted((m.record.payload, m.attempt) for m in again) == [(b"1", 2), (b"2", 2)]
            by_payload = {m.record.payload: m for m in again}
            assert await client.pop_ack([by_payload[b"1"].handle]) == [True]
            assert await client.change_invisible(by_payload[b"2"].handle, 0.0) is not None  # its last attempt

        ask_store(store.port, second_round)
        wait_for(lambda: pop_figures(port) == (1, 0, 0, 5, 2, 2, 1), "the last one to be dead-lettered")
        gateway.stop()
        assert not gateway.errors() and not store.errors()
