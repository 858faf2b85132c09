"""The leader-epoch file kept with the CommitLog: which epoch's leader wrote the log from which offset.

Replication asks it where a follower's log stops agreeing with the leader's: the follower sends the
epoch of its last record, the leader answers with that epoch's end offset (the start of the next epoch,
or its own written offset for the current one), and the follower truncates there (Kafka's
leader-epoch checkpoint, RocketMQ's EpochFile). Epochs and start offsets only grow.

Format (``<data>/commitlog/epochs``, text, one entry a line)::

    lightgate-epochs 1
    <epoch> <start offset>
    ...
    crc32c <8 hex digits over every byte before this line>

Every change rewrites the whole file (a few lines: epochs change rarely): temporary file, fsync, rename,
directory fsync, so a crash leaves the old file or the new one. A file that does not parse or whose CRC
disagrees is damage, not a torn write, and stops the store with a :class:`StartupError`.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import final

from crc32c import crc32c

from store.log.errors import StartupError

__all__ = ["EPOCHS_FILE", "EpochFile"]

EPOCHS_FILE = "epochs"
FORMAT_LINE = "lightgate-epochs 1"


@final
class EpochFile:
    """The epoch -> start offset entries of one CommitLog directory, oldest first.

    Concurrency: the replication calls it from one task at a time; it takes no lock.
    """

    def __init__(self, path: Path, entries: list[tuple[int, int]]) -> None:
        """Use :meth:`open`."""
        self._path = path
        self._epochs = [epoch for epoch, _ in entries]
        self._starts = [start for _, start in entries]

    @classmethod
    def open(cls, directory: Path) -> EpochFile:
        """Read ``<directory>/epochs`` (none: no entries; a leftover temporary file is removed).

        Raises:
            StartupError: the file is damaged (unknown format, bad CRC, epochs or offsets not increasing).
        """
        path = Path(directory) / EPOCHS_FILE
        path.with_name(EPOCHS_FILE + ".tmp").unlink(missing_ok=True)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(path, [])
        try:
            entries = _parse(raw)
        except ValueError as exc:
            raise StartupError(f"cannot start: the epoch file {path} is damaged ({exc}); restore it from a "
                               f"replica or a backup of this directory") from None
        return cls(path, entries)

    @property
    def entries(self) -> list[tuple[int, int]]:
        return list(zip(self._epochs, self._starts))

    @property
    def latest(self) -> tuple[int, int] | None:
        """The newest (epoch, start offset), or None when there is none."""
        return (self._epochs[-1], self._starts[-1]) if self._epochs else None

    def append(self, epoch: int, start: int) -> None:
        """Record that ``epoch`` starts at ``start`` (durable on return). Appending the latest entry again is a
        no-op.

        Raises:
            ValueError: ``epoch`` is not above the latest epoch, or ``start`` is below the latest start.
            OSError: the file could not be written; it is unchanged.
        """
        if self.latest == (epoch, start):
            return
        if epoch < 0 or start < 0 or (self._epochs and (epoch <= self._epochs[-1] or start < self._starts[-1])):
            raise ValueError(f"epoch {epoch} at offset {start} does not follow the latest entry {self.latest}:"
                             f" epochs and start offsets only grow")
        self._save([*self.entries, (epoch, start)])

    def end_offset(self, epoch: int, written: int) -> int | None:
        """Where ``epoch``'s records end in this log: the start of the first later epoch, or ``written`` when
        no later epoch exists. None when ``epoch`` is older than every entry (the follower truncates to its
        start: nothing it has is known to agree)."""
        if not self._epochs or epoch < self._epochs[0]:
            return None
        i = bisect.bisect_right(self._epochs, epoch)
        return self._starts[i] if i < len(self._starts) else written

    def epoch_at(self, offset: int) -> int | None:
        """The epoch whose leader wrote the record at ``offset`` (None: before the first entry)."""
        i = bisect.bisect_right(self._starts, offset) - 1
        return self._epochs[i] if i >= 0 else None

    def truncate_from(self, offset: int) -> None:
        """Drop the entries that start at or after ``offset`` (the log is cut there). Durable on return."""
        keep = bisect.bisect_left(self._starts, offset)
        if keep < len(self._starts):
            self._save(self.entries[:keep])

    def _save(self, entries: list[tuple[int, int]]) -> None:
        body = "".join(f"{line}\n" for line in [FORMAT_LINE, *(f"{e} {s}" for e, s in entries)]).encode()
        data = body + f"crc32c {crc32c(body):08x}\n".encode()
        tmp = self._path.with_name(EPOCHS_FILE + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self._path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._epochs = [epoch for epoch, _ in entries]
        self._starts = [start for _, start in entries]


def _parse(raw: bytes) -> list[tuple[int, int]]:
    """The entries of an epoch file's bytes; ValueError saying what is wrong."""
    body, sep, last = raw.rstrip(b"\n").rpartition(b"\n")
    if not sep or not last.startswith(b"crc32c "):
        raise ValueError("no crc32c line at its end")
    body += b"\n"
    if last[7:].decode("ascii", "replace") != f"{crc32c(body):08x}":
        raise ValueError("CRC mismatch")
    lines = body.decode().splitlines()
    if lines[0] != FORMAT_LINE:
        raise ValueError(f"unknown format line {lines[0]!r}")
    entries: list[tuple[int, int]] = []
    for line in lines[1:]:
        epoch, start = (int(field) for field in line.split(" "))
        if entries and (epoch <= entries[-1][0] or start < entries[-1][1]):
            raise ValueError(f"entry {line!r} does not follow {entries[-1]}")
        entries.append((epoch, start))
    return entries
