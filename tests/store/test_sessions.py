"""Session state as control records (store/sessions.py, store/ledger.py, store/awaiting.py) on real RocksDB, files
and processes: every kind is written to the log and applied; the ``sessions``, ``clients`` and ``qos2`` families
are derived from the log alone (deleted, they come back identical); a SIGKILL between the append and dispatch,
and a power loss under ``sync``, cost nothing acknowledged.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from store.api import Flow, NewMessage, session_image, session_parts
from store.awaiting import AwaitingRelease
from store.control import decode_control, encode_control
from store.ledger import ClientLedger
from store.local import LocalStore
from store.log.commitlog import CommitLog, CommitLogConfig
from store.node import open_store
from store.rocks import open_db
from store.sessions import SessionBlobs
from tests.helpers.processes import ROOT
from tests.helpers.derived import control_kinds, derived, drop_families
from tests.helpers.powerloss import lose_unflushed_tail

HOUR = 3600


def will(client_id: str) -> NewMessage:
    return NewMessage(f"will/{client_id}", b"gone", client_id, 1)


async def wait_until(condition) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.sleep(0.01)


async def lifecycle(data: Path) -> None:
    """Every step a session and a client go through, on one store (leases of an hour: nothing ends by itself
    in a restart, so the derived state is the same before and after)."""
    async with open_store(data, CommitLogConfig(), lease_s=HOUR) as node:
        gw = LocalStore(node, "gw", lease=True)
        await gw.open_session("kept", clean_start=False, expiry_s=HOUR, will=will("kept"), will_delay_s=HOUR)
        await gw.save_session("kept", b"kept-1")
        await gw.patch_session("kept", {"a": b"a-1", "b": b"b-1"})
        await gw.save_session("kept", b"kept-2")  # holds the parts patched before it: they go
        await gw.patch_session("kept", {"c": b"c-1", "d": b"d-1"})
        await gw.patch_session("kept", {"d": b"", "c": b"c-2"})  # an empty part removes its key
        await gw.patch_session("nobody", {"a": b"a-1"})  # no blob: dropped
        await gw.close_session("kept", expiry_s=HOUR, will_delay_s=HOUR)  # closed, its will pending
        await gw.open_session("here", clean_start=False, expiry_s=HOUR, will=will("here"), will_delay_s=5)
        await gw.save_session("here", b"here")  # connected when the store stops
        await gw.open_session("fired", clean_start=False, expiry_s=HOUR, will=will("fired"), will_delay_s=0)
        await gw.close_session("fired", expiry_s=HOUR, will_delay_s=0)  # its will published at once
        await wait_until(lambda: node.leases.statistics().wills_fired == 1)
        await gw.open_session("ended", clean_start=False, expiry_s=HOUR, will=None, will_delay_s=0)
        await gw.save_session("ended", b"ended")
        await gw.patch_session("ended", {"a": b"a-1"})
        offsets = await gw.append([NewMessage("q", b"x", "ended", 2, packet_id=7)])
        await gw.close_session("ended", expiry_s=0, will_delay_s=None)  # a clean session's close ends it
        await gw.open_session("pub", clean_start=False, expiry_s=HOUR, will=None, will_delay_s=0)
        offsets = await gw.append([NewMessage("q", str(pid).encode(), "pub", 2, packet_id=pid) for pid in (1, 2, 3)])
        await gw.release_awaiting([Flow("pub", 2, offsets[1])])
        assert await gw.awaiting_release("pub") == {1: offsets[0], 3: offsets[2]}
        assert await gw.awaiting_release("ended") == {}
        gw.close()


async def restart(data: Path) -> None:
    async with open_store(data, CommitLogConfig(), lease_s=HOUR):
        pass


def test_every_step_of_a_session_is_a_control_record_and_applied(tmp_path):
    trio.run(lifecycle, tmp_path)
    assert set(control_kinds(tmp_path)) == {"session_saved", "session_patched", "session_ended", "flows_released",
                                            "client_connected", "client_closed", "will_published", "client_forgotten"}
    state = derived(tmp_path)
    # "ended" went with its session, its parts too; "kept" is its last blob with the parts patched since
    assert state["sessions"] == {"kept": session_image(b"kept-2", {"c": b"c-2"}), "here": b"here"}
    assert session_parts(state["sessions"]["kept"]) == (b"kept-2", {"c": b"c-2"})
    clients = state["clients"]
    assert sorted(clients) == ["fired", "here", "kept", "pub"]  # "ended": forgotten
    assert clients["kept"].closed_ms and clients["kept"].will == will("kept")  # pending
    assert clients["fired"].closed_ms and clients["fired"].will is None  # published: not again after a restart
    assert not clients["here"].closed_ms and clients["here"].will == will("here")  # held while connected
    assert [(c, pid) for c, pid, _ in state["awaiting"]] == [("pub", 1), ("pub", 3)]


@pytest.mark.parametrize("lose", ["families", "index"])
def test_the_derived_families_come_back_identical_from_the_log(tmp_path, lose):
    trio.run(lifecycle, tmp_path)
    before = derived(tmp_path)
    if lose == "families":
        drop_families(tmp_path)
    else:
        shutil.rmtree(tmp_path / "index")
    trio.run(restart, tmp_path)
    assert derived(tmp_path) == before


def test_restated_records_make_the_same_state(tmp_path):
    """``restate()`` of each applier, applied to empty families, derives what the log made (what retention keeps
    once it deletes the records that made it)."""
    trio.run(lifecycle, tmp_path)
    before = derived(tmp_path)
    db = open_db(tmp_path / "index")
    parts = SessionBlobs(db), ClientLedger(db), AwaitingRelease(db)
    restated = [c for part in parts for c in (part.controls if isinstance(part, AwaitingRelease) else part).restate()]
    for part in parts:
        part.close()
    db.close()
    other = tmp_path / "other"
    db = open_db(other / "index")
    blobs, ledger, awaiting = SessionBlobs(db), ClientLedger(db), AwaitingRelease(db)
    offset = 0
    for control in restated:
        _, record = encode_control(control, 1, 1 << 20)
        record.offset = offset
        offset += record.size
        for applier in (blobs, ledger, awaiting.controls):
            applier.apply(record, control)
    for part in (blobs, ledger, awaiting):
        part.close()
    db.close()
    assert derived(other) == before


WRITER = textwrap.dedent("""
    import os, signal, sys, trio
    from pathlib import Path
    from store.control import SessionSaved, encode_control
    from store.local import LocalStore
    from store.log.commitlog import CommitLogConfig
    from store.node import open_store

    async def main():
        async with open_store(Path(sys.argv[1]), CommitLogConfig(flush=sys.argv[2])) as node:
            gw = LocalStore(node, "gw", lease=True)
            await gw.open_session("applied", clean_start=False, expiry_s=60)
            await gw.save_session("applied", b"applied")  # acknowledged: stored; RocksDB holds it unflushed at most
            await gw.open_session("pending", clean_start=False, expiry_s=60)
            raw, _ = encode_control(SessionSaved("pending", b"pending"), 1, 1 << 20)
            await node.log.append_batch([raw], durable=True)  # appended, dispatch never woken for it
            print("acknowledged", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    trio.run(main)
""")


def crash(data: Path, flush: str) -> None:
    proc = subprocess.run([sys.executable, "-c", WRITER, str(data), flush], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == -signal.SIGKILL and proc.stdout == "acknowledged\n", proc.stderr


async def loaded(data: Path, flush: str) -> dict:
    async with open_store(data, CommitLogConfig(flush=flush)) as node:
        gw = LocalStore(node, "gw")
        return {cid: await gw.load_session(cid) for cid in ("applied", "pending")}


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_sigkill_between_append_and_dispatch_loses_no_save(tmp_path, flush):
    crash(tmp_path, flush)
    assert trio.run(loaded, tmp_path, flush) == {"applied": b"applied", "pending": b"pending"}


def test_a_power_loss_under_sync_loses_no_acknowledged_save(tmp_path):
    crash(tmp_path, "sync")
    lose_unflushed_tail(tmp_path / "commitlog")  # the log as a power loss leaves it: RocksDB as the kill left it
    assert trio.run(loaded, tmp_path, "sync") == {"applied": b"applied", "pending": b"pending"}
    assert derived(tmp_path)["clients"].keys() == {"applied", "pending"}  # connected before their CONNACKs


def test_a_rewind_past_an_applied_record_forgets_the_family_until_the_log_is_applied_again(tmp_path):
    """A follower's log cut below records it applied (``ControlApplier.rewind``): a family that keeps no history
    starts again from the log's first record, and dispatch derives it again from what the log still holds."""
    trio.run(lifecycle, tmp_path)
    before = derived(tmp_path)
    db = open_db(tmp_path / "index")
    blobs = SessionBlobs(db)
    with CommitLog.open(tmp_path / "commitlog", CommitLogConfig()) as log:
        records = [r for r in log.scan(log.min_offset, 1 << 30).records if r.control]
    last = records[-1]
    blobs.rewind(last.offset + last.size)  # nothing applied at or past the end: kept
    assert blobs.checkpoint and dict(blobs.items()) == before["sessions"]
    blobs.apply(last, decode_control(last))
    blobs.rewind(last.offset)  # the last record applied is past the new end
    assert blobs.checkpoint == 0 and dict(blobs.items()) == {}
    for record in records:
        blobs.apply(record, decode_control(record))
    assert dict(blobs.items()) == before["sessions"]
    blobs.close()
    db.close()
