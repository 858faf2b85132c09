"""The POP groups' state (store/pop/state.py): made only by applying records, no I/O."""

from store.control import PopAcked, PopCheckpoint, PopRestated, PopRevived
from store.pop.state import MAX_INFLIGHT, PopBook

KEY = ("g", "tele/#")


def ck(offsets, attempts=None, pop_ms=1000, invisible_ms=500, cursor=None, gone=(), max_attempts=3, member="m"):
    return PopCheckpoint("g", "tele/#", member, list(offsets), list(attempts or [1] * len(offsets)), pop_ms,
                         invisible_ms, cursor if cursor is not None else max(offsets, default=-1) + 1, max_attempts,
                         list(gone))


def test_a_checkpoint_puts_its_messages_in_flight_and_moves_the_cursor():
    book = PopBook()
    assert book.apply(100, ck([0, 1, 2])) == KEY
    group = book.groups[KEY]
    assert group.cursor == 3 and sorted(group.inflight) == [0, 1, 2]
    assert group.inflight[1].ck == 100 and group.inflight[1].deadline_ms == 1500
    assert group.committed() == 0


def test_an_ack_matches_only_the_checkpoint_that_holds_the_message_and_committed_moves_past_acked_ones():
    book = PopBook()
    book.apply(100, ck([0, 1, 2]))
    book.apply(200, PopAcked("g", "tele/#", [(0, 100), (1, 999)]))  # 999: no such checkpoint: stale
    group = book.groups[KEY]
    assert sorted(group.inflight) == [1, 2] and book.acked == 1
    assert group.committed() == 1
    book.apply(300, PopAcked("g", "tele/#", [(1, 100), (2, 100)]))
    assert group.committed() == 3 and not group.inflight


def test_revive_makes_a_message_visible_for_its_next_attempt_and_a_late_ack_of_it_is_stale():
    book = PopBook()
    book.apply(100, ck([0, 1]))
    group = book.groups[KEY]
    assert [offset for offset, _ in group.due(1499)] == []
    assert sorted(offset for offset, _ in group.due(1500)) == [0, 1]
    book.apply(200, PopRevived("g", "tele/#", [(0, 100)]))
    assert group.retry == {0: 2} and list(group.inflight) == [1]
    book.apply(300, PopAcked("g", "tele/#", [(0, 100)]))  # the old handle: stale
    assert group.retry == {0: 2} and book.acked == 0
    assert group.plan(10) == ([0], 9)
    book.apply(400, ck([0], attempts=[2], cursor=2))
    assert group.inflight[0].attempt == 2 and group.inflight[0].ck == 400 and not group.retry


def test_a_dead_letter_is_done_and_a_gone_retry_too():
    book = PopBook()
    book.apply(100, ck([0, 1]))
    book.apply(200, PopRevived("g", "tele/#", [(1, 100)], dead=[(0, 100)]))
    group = book.groups[KEY]
    assert book.dead == 1 and group.committed() == 1
    book.apply(300, ck([], cursor=2, gone=[1]))
    assert group.committed() == 2 and not group.retry


def test_a_new_checkpoint_of_one_message_changes_its_invisible_time_and_its_old_handle_goes_stale():
    book = PopBook()
    book.apply(100, ck([0, 1]))
    book.apply(200, ck([1], pop_ms=5000, invisible_ms=10, cursor=2))
    group = book.groups[KEY]
    assert group.held_by(1, 100) is None and group.held_by(1, 200).deadline_ms == 5010
    assert group.held_by(0, 100) is not None


def test_the_in_flight_cap_bounds_what_a_pop_may_take():
    book = PopBook()
    book.apply(100, ck(range(MAX_INFLIGHT - 5)))
    assert book.groups[KEY].plan(100) == ([], 5)
    book.apply(200, ck(range(MAX_INFLIGHT - 5, MAX_INFLIGHT)))
    assert book.groups[KEY].plan(100) == ([], 0)


def test_a_restatement_replaces_the_group_as_it_was():
    book = PopBook()
    book.apply(100, ck([0, 1, 2]))
    book.apply(200, PopRevived("g", "tele/#", [(2, 100)]))
    (restated,) = book.restate()
    assert isinstance(restated, PopRestated)
    other = PopBook()
    other.apply(900, restated)
    assert other.groups == book.groups
