"""The leader-epoch file (store/log/epochs.py): epochs and start offsets that only grow, the end offset a
follower truncates to, truncation with the log, and damage found on open."""

from __future__ import annotations

import pytest

from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.epochs import EPOCHS_FILE, EpochFile
from store.log.errors import StartupError
from store.log.record import encode_record


def test_epochs_are_kept_across_opens_and_answer_the_end_offset_of_an_epoch(tmp_path):
    epochs = EpochFile.open(tmp_path)
    assert epochs.latest is None and epochs.end_offset(3, 100) is None
    epochs.append(1, 0)
    epochs.append(4, 500)
    epochs.append(4, 500)  # the same entry again: nothing to do
    epochs.append(6, 500)  # an epoch whose leader wrote nothing: it starts where the next does
    again = EpochFile.open(tmp_path)
    assert again.entries == [(1, 0), (4, 500), (6, 500)]
    assert again.end_offset(1, 900) == 500 and again.end_offset(2, 900) == 500  # an unknown epoch: the older one's
    assert again.end_offset(4, 900) == 500 and again.end_offset(6, 900) == 900 and again.end_offset(0, 900) is None
    assert again.epoch_at(499) == 1 and again.epoch_at(500) == 6
    with pytest.raises(ValueError, match="only grow"):
        again.append(5, 600)
    with pytest.raises(ValueError, match="only grow"):
        again.append(7, 400)
    again.truncate_from(500)
    assert EpochFile.open(tmp_path).entries == [(1, 0)]


@pytest.mark.parametrize("damage", [
    lambda raw: raw.replace(b" 500\n", b" 501\n"),  # a changed offset: the CRC disagrees
    lambda raw: raw[:-4],  # torn
    lambda raw: raw.replace(b"lightgate-epochs 1", b"lightgate-epochs 9"),
    lambda raw: b"",
])
def test_a_damaged_epoch_file_stops_the_log_from_opening_with_one_clear_line(tmp_path, damage):
    with CommitLog.open(tmp_path, CommitLogConfig(segment_bytes=4096, max_record_bytes=1024)) as log:
        log.epochs.append(1, 0)
        log.epochs.append(2, 500)
    path = tmp_path / EPOCHS_FILE
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(StartupError, match=f"epoch file {path} is damaged"):
        CommitLog.open(tmp_path, CommitLogConfig(segment_bytes=4096, max_record_bytes=1024))


def test_a_leftover_temporary_file_is_ignored_and_epochs_past_a_recovered_end_are_dropped(tmp_path):
    config = CommitLogConfig(segment_bytes=4096, max_record_bytes=1024)
    with CommitLog.open(tmp_path, config) as log:
        log.append(encode_record("t", b"x" * 100))
        end = log.written_offset
        log.epochs.append(1, 0)
        log.epochs.append(2, end)
    EpochFile(tmp_path / EPOCHS_FILE, [(1, 0), (2, end), (3, end + 50)])._save([(1, 0), (2, end), (3, end + 50)])
    (tmp_path / (EPOCHS_FILE + ".tmp")).write_bytes(b"half a file")
    with CommitLog.open(tmp_path, config) as log:  # the log ends at ``end``: epoch 3 started past it
        assert log.epochs.entries == [(1, 0), (2, end)]
    assert not (tmp_path / (EPOCHS_FILE + ".tmp")).exists()
