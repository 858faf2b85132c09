"""A power loss, as the CommitLog sees it: what the disk keeps is what was flushed."""

from pathlib import Path

from store.log.commitlog import read_flushed_hint
from store.log.segment import parse_segment_name


def lose_unflushed_tail(commitlog: Path) -> int:
    """Make the log what a power loss leaves: zeros from the flushed mark on, no later segment. Returns the
    bytes dropped."""
    mark = read_flushed_hint(commitlog)
    assert mark is not None
    dropped = 0
    for path in sorted(commitlog.iterdir()):
        base = parse_segment_name(path.name)
        if base is None:
            continue
        size = path.stat().st_size
        if base > mark:
            dropped += len(path.read_bytes().rstrip(b"\0"))
            path.unlink()
            path.with_name(path.name + ".meta").unlink(missing_ok=True)
        elif base + size > mark:
            with open(path, "r+b") as f:
                f.seek(mark - base)
                dropped += len(f.read().rstrip(b"\0"))
                f.truncate(mark - base)
                f.truncate(size)
    return dropped
