"""The store's derived column families as tests read and damage them: canonically, dropped, and the control
records that make them."""

from pathlib import Path

import rocksdict

from store.awaiting import AWAITING_FAMILY, AwaitingRelease
from store.control import FlowsAwaiting, decode_control
from store.ledger import LEDGER_FAMILY, ClientLedger
from store.log.commitlog import CommitLog, CommitLogConfig
from store.rocks import open_db
from store.sessions import SESSIONS_FAMILY, SessionBlobs

FAMILIES = (SESSIONS_FAMILY, LEDGER_FAMILY, AWAITING_FAMILY)
"""The families derived from the client-keyed control records (store/sessions.py, ledger.py, awaiting.py)."""


def derived(data: Path) -> dict:
    """The derived families, canonically: blobs, ledger entries, flows awaiting release (released ones are kept
    only until the next flush)."""
    db = open_db(data / "index")
    blobs, ledger, awaiting = SessionBlobs(db), ClientLedger(db), AwaitingRelease(db)
    try:
        flows = sorted(flow for c in awaiting.restate() if isinstance(c, FlowsAwaiting) for flow in c.flows)
        return {"sessions": dict(blobs.items()), "clients": ledger.entries(), "awaiting": flows}
    finally:
        for part in (blobs, ledger, awaiting):
            part.close()
        db.close()


def drop_families(data: Path) -> None:
    index = str(data / "index")
    db = rocksdict.Rdict(index, column_families={name: rocksdict.Options(raw_mode=True)
                                                 for name in rocksdict.Rdict.list_cf(index)},
                         options=rocksdict.Options(raw_mode=True))
    for name in FAMILIES:
        db.drop_column_family(name)
    db.close()


def control_kinds(data: Path) -> list[str]:
    return [kind for kind, _ in control_sizes(data)]


def control_sizes(data: Path) -> list[tuple[str, int]]:
    """Each control record's kind and size in bytes, in log order."""
    with CommitLog.open(data / "commitlog", CommitLogConfig()) as log:
        records = log.scan(log.min_offset, 1 << 30).records
    return [(type(decode_control(r)).__struct_config__.tag, r.size) for r in records if r.control]
