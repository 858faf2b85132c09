"""Timer test helpers (store/timer/): Delayed and control records made by hand for a ``TimerApplier``, and the
``TimersFired`` records a store's log holds."""

from __future__ import annotations

from store.control import Control, Delayed, TimersFired, decode_control, encode_control
from store.log.record import Record, now_ms
from store.node import StoreNode


def delayed_record(offset: int, due_ms: int, store_ms: int = 0, client: str = "c") -> tuple[Record, Delayed]:
    """A Delayed record of ``client`` at ``offset``, due at ``due_ms``, stored at ``store_ms`` (default: a second
    before)."""
    control = Delayed(client, "t", due_ms, b"x")
    _, record = encode_control(control, store_ms or due_ms - 1000, 1 << 20)
    record.offset = offset
    return record, control


def control_record(offset: int, control: Control) -> Record:
    _, record = encode_control(control, now_ms(), 1 << 20)
    record.offset = offset
    return record


def timers_fired(node: StoreNode) -> list[TimersFired]:
    """Every TimersFired record in the log, in log order."""
    found = []
    offset = node.log.log.min_offset
    while offset < node.log.log.written_offset:
        scan = node.log.log.scan(offset)
        for record in scan.records:
            if record.control:
                control = decode_control(record)
                if isinstance(control, TimersFired):
                    found.append(control)
        offset = scan.next_offset
    return found
