"""ACL files: parsing with line-numbered errors, rule order, substitution, subscribe coverage, caches."""

import itertools

import pytest

from gateway.auth import acl as acl_module
from gateway.auth.acl import Access, Acl, AclError, ClientAcl, filter_covers
from lightqueue.topics import TopicError, filters_overlap, matches, validate_filter

PUB, SUB = Access.PUBLISH, Access.SUBSCRIBE

FLEET = """\
# the fleet's ACL
default deny

user alice
deny publish alice/readonly/#
allow both alice/#

user ops
allow subscribe #

client sensor-17
allow publish legacy/s17

pattern
allow publish tele/%c/#
allow subscribe cmd/%c/#
allow both home/%u/#
"""


@pytest.fixture
def fleet():
    return Acl.parse(FLEET, "fleet.acl")


def test_user_rules_allow_their_namespace(fleet):
    assert fleet.check("alice", "phone", PUB, "alice/notes")
    assert fleet.check("alice", "phone", SUB, "alice/#")
    assert not fleet.check("bob", "phone", PUB, "alice/notes")
    assert not fleet.check(None, "phone", PUB, "alice/notes")


def test_deny_listed_before_allow_wins(fleet):
    assert not fleet.check("alice", "phone", PUB, "alice/readonly/x")
    assert fleet.check("alice", "phone", SUB, "alice/readonly/x")  # the deny is for publish only


def test_first_matching_rule_wins_so_allow_before_deny_allows():
    acl = Acl.parse("user a\nallow publish x/#\ndeny publish x/secret\n")
    assert acl.check("a", "c", PUB, "x/secret")
    assert acl.explain("a", "c", PUB, "x/secret").rule.line == 2


def test_default_policy_decides_when_no_rule_matches():
    assert not Acl.parse("").check("u", "c", PUB, "t")  # no default line: deny
    assert not Acl.parse("default deny\n").check("u", "c", PUB, "t")
    assert Acl.parse("default allow\n").check("u", "c", PUB, "t")
    decision = Acl.parse("default allow\nuser u\ndeny publish t\n").explain("u", "c", PUB, "other")
    assert decision.allowed and decision.rule is None


def test_default_line_may_come_after_sections():
    acl = Acl.parse("user u\ndeny publish t\ndefault allow\n")
    assert acl.check("u", "c", PUB, "other") and not acl.check("u", "c", PUB, "t")


def test_client_rules_apply_by_client_id(fleet):
    assert fleet.check(None, "sensor-17", PUB, "legacy/s17")
    assert not fleet.check(None, "sensor-18", PUB, "legacy/s17")


def test_user_rules_come_before_client_rules_before_patterns():
    acl = Acl.parse("pattern\nallow publish t\nclient c\ndeny publish t\nuser u\nallow publish t\n")
    assert acl.explain("u", "c", PUB, "t").rule.line == 6  # user section, though last in the file
    assert acl.explain("v", "c", PUB, "t").rule.line == 4  # then the client section
    assert acl.explain("v", "d", PUB, "t").rule.line == 2  # then patterns


def test_sections_for_the_same_user_are_merged_in_file_order():
    acl = Acl.parse("user u\ndeny publish a\nuser v\nallow publish a\nuser u\nallow publish #\n")
    assert not acl.check("u", "c", PUB, "a") and acl.check("u", "c", PUB, "b")


def test_pattern_substitutes_client_id_and_user(fleet):
    assert fleet.check(None, "dev1", PUB, "tele/dev1/temp")
    assert not fleet.check(None, "dev1", PUB, "tele/dev2/temp")
    assert fleet.check(None, "dev1", SUB, "cmd/dev1/#")
    assert not fleet.check(None, "dev1", SUB, "cmd/dev2/#")
    assert fleet.check("bob", "x", PUB, "home/bob/lamp")
    assert not fleet.check("bob", "x", PUB, "home/carol/lamp")


def test_substitution_inside_a_level():
    acl = Acl.parse("pattern\nallow publish site/%u-%c/data\n")
    assert acl.check("acme", "d1", PUB, "site/acme-d1/data")
    assert not acl.check("acme", "d2", PUB, "site/acme-d1/data")


def test_anonymous_clients_get_no_user_patterns(fleet):
    assert not fleet.check(None, "x", PUB, "home//lamp")
    assert not fleet.check(None, "x", PUB, "home/None/lamp")
    assert fleet.check(None, "x", PUB, "tele/x/t")  # %c patterns still apply


@pytest.mark.parametrize("evil", ["#", "+", "a/b", "home/#", "$SYS", "x\0y", ""])
def test_wildcards_or_slashes_in_user_or_client_id_do_not_widen_access(fleet, evil):
    """`home/%u/#` with user '#' would be `home/#/#`; with 'a/b' it would reach into another user's tree."""
    assert not fleet.check(evil, "c", PUB, "home/a/b/lamp")
    assert not fleet.check(evil, "c", SUB, "home/#")
    assert not fleet.check(evil, "c", SUB, "home/+/lamp")
    assert not fleet.check("u", evil, SUB, "cmd/#")
    assert not fleet.check("u", evil, PUB, "tele/a/b")


def test_client_id_dollar_cannot_reach_sys_topics():
    acl = Acl.parse("pattern\nallow both %c/#\n")
    assert acl.check("u", "dev", SUB, "dev/#")
    assert not acl.check("u", "$SYS", SUB, "$SYS/#")
    assert not acl.check("u", "$SYS", PUB, "$SYS/broker/uptime")


def test_a_deny_rule_that_cannot_be_substituted_denies():
    """Skipping it would let the later allow through: an unsafe value must never remove a deny."""
    acl = Acl.parse("pattern\ndeny publish private/%u/#\nallow publish #\n")
    assert acl.check("bob", "c", PUB, "private/alice/x")
    assert not acl.check("bob", "c", PUB, "private/bob/x")
    assert not acl.check("a/b", "c", PUB, "private/a/b/x")
    assert not acl.check("#", "c", PUB, "anything")
    assert acl.explain("#", "c", PUB, "anything").rule.line == 2


def test_a_user_name_containing_percent_c_is_not_substituted_twice():
    acl = Acl.parse("pattern\nallow publish u/%u/c/%c\n")
    assert acl.check("x%cy", "dev", PUB, "u/x%cy/c/dev")
    assert not acl.check("x%cy", "dev", PUB, "u/xdevy/c/dev")


def test_subscribe_needs_the_rule_to_cover_the_whole_filter():
    acl = Acl.parse("user u\nallow subscribe a/#\nallow subscribe b/+\n")
    assert acl.check("u", "c", SUB, "a/#")
    assert acl.check("u", "c", SUB, "a/+/x")
    assert acl.check("u", "c", SUB, "a")
    assert acl.check("u", "c", SUB, "b/x")
    assert acl.check("u", "c", SUB, "b/+")
    assert not acl.check("u", "c", SUB, "b/#")  # b/# also receives b and b/x/y
    assert not acl.check("u", "c", SUB, "b/x/y")
    assert not acl.check("u", "c", SUB, "#")


def test_subscribe_deny_rules_refuse_any_overlap_in_refuse_mode():
    """`auth.acl_wildcard_mode = "refuse"`: `deny subscribe secret/#` also refuses `#`, which would deliver
    secret/... messages."""
    acl = Acl.parse("user u\ndeny subscribe secret/#\nallow subscribe #\n", wildcard_mode="refuse")
    assert not acl.check("u", "c", SUB, "#")
    assert not acl.check("u", "c", SUB, "+/x")
    assert not acl.check("u", "c", SUB, "secret")
    assert acl.check("u", "c", SUB, "public/#")
    assert acl.check("u", "c", SUB, "secrets/x")


def test_subscribe_deny_rules_refuse_what_they_cover_in_filter_mode():
    """The default, as Mosquitto and EMQX: a wildcard overlapping a deny rule is granted (the denied topics are
    withheld at delivery); what the deny rule covers is refused."""
    acl = Acl.parse("default allow\npattern\ndeny subscribe test/nosubscribe\ndeny subscribe secret/#\n")
    assert acl.wildcard_mode == "filter"
    for granted in ("#", "+/+", "test/+", "+/nosubscribe", "+", "public/#"):
        assert acl.check("u", "c", SUB, granted), granted
    for refused in ("test/nosubscribe", "secret/#", "secret/+", "secret/a/b", "secret"):  # `secret/#` has `secret`
        assert not acl.check("u", "c", SUB, refused), refused
    read = ClientAcl(lambda: acl, lambda: acl, "u", "c").may_read
    assert [read(t) for t in ("test/nosubscribe", "test/x", "secret/a", "secret", "secrets/a")] == \
        [False, True, False, False, True]


def test_read_check_decides_each_topic_once_and_starts_over_on_a_reloaded_acl():
    current = [Acl.parse("default allow\npattern\ndeny subscribe a/x\n")]
    read = ClientAcl(lambda: current[0], lambda: current[0], None, "c").may_read
    calls = []
    current[0].check = lambda *args: calls.append(args) or args[3] != "a/x"  # count the ACL's decisions
    assert [read("a/x"), read("a/y"), read("a/x"), read("a/y")] == [False, True, False, True]
    assert len(calls) == 2
    current[0] = Acl.parse("default allow\npattern\ndeny subscribe a/y\n")  # reloaded
    assert [read("a/x"), read("a/y")] == [True, False]


def test_an_unknown_wildcard_mode_is_refused():
    with pytest.raises(ValueError, match="wildcard_mode"):
        Acl.parse("default allow\n", wildcard_mode="lenient")


def test_publish_and_subscribe_are_separate_rights(fleet):
    assert not fleet.check(None, "dev1", SUB, "tele/dev1/#")
    assert not fleet.check(None, "dev1", PUB, "cmd/dev1/reboot")
    assert fleet.check("ops", "x", SUB, "tele/+/temp") and not fleet.check("ops", "x", PUB, "tele/a/temp")


def test_shared_subscriptions_are_checked_by_their_filter():
    acl = Acl.parse("user u\nallow subscribe jobs/#\n")
    assert acl.check("u", "c", SUB, "$share/workers/jobs/#")
    assert not acl.check("u", "c", SUB, "$share/workers/other/#")
    assert not acl.check("u", "c", SUB, "$share//jobs")  # malformed share: refused, not an exception


def test_wildcard_rules_do_not_reach_dollar_topics():
    acl = Acl.parse("default deny\nuser u\nallow both #\n")
    assert acl.check("u", "c", PUB, "a/b")
    assert not acl.check("u", "c", PUB, "$SYS/x")
    assert not acl.check("u", "c", SUB, "$SYS/#")
    assert Acl.parse("user u\nallow subscribe $SYS/#\n").check("u", "c", SUB, "$SYS/broker/+")


@pytest.mark.parametrize(
    "text, message",
    [
        ("allow publish a\n", "x.acl:1: a rule must follow"),
        ("# c\n\nuser u\nallow read a\n", "x.acl:4: expected publish, subscribe or both after 'allow', not 'read'"),
        ("user u\ndeny publish\n", "x.acl:2: 'deny publish' needs a topic filter"),
        ("user u\nallow publish a/#/b\n", "x.acl:2: topic filter 'a/#/b': '#' must be the last level"),
        ("user u\nallow both a/b+\n", "x.acl:2: topic filter 'a/b+': '+' must occupy a whole level"),
        ("pattern\nallow both a/%u+\n", "x.acl:2: topic filter 'a/%u+': '+' must occupy a whole level"),
        ("user u\nallow both $share/g/a\n", "x.acl:2: rules name topics, not shared subscriptions"),
        ("default deny\ndefault allow\n", "x.acl:2: the default policy is already set on line 1"),
        ("default maybe\n", "x.acl:1: expected 'default allow' or 'default deny'"),
        ("user\n", "x.acl:1: user name must not be empty"),
        ("user a:b\n", "x.acl:1: user name 'a:b' must not contain ':'"),
        ("client\n", "x.acl:1: 'client ID' needs a client id"),
        ("pattern all\n", "x.acl:1: 'pattern' starts a section and takes no argument"),
        ("topic read a/b\n", "x.acl:1: unknown keyword 'topic'"),
    ],
)
def test_errors_name_the_line(text, message):
    with pytest.raises(AclError) as info:
        Acl.parse(text, "x.acl")
    assert message in str(info.value)


def test_load_reads_a_file_and_reports_missing_ones(tmp_path):
    path = tmp_path / "a.acl"
    path.write_text(FLEET)
    assert Acl.load(path).check("alice", "p", PUB, "alice/x")
    with pytest.raises(AclError, match="cannot read the ACL file"):
        Acl.load(tmp_path / "missing.acl")
    path.write_text("user u\nallow bogus x\n")
    with pytest.raises(AclError, match=f"{path}:2:"):
        Acl.load(path)


def test_filters_with_spaces_and_tabs_between_words():
    acl = Acl.parse("user u\n  allow\tpublish   room 1/temp  \n")
    assert acl.check("u", "c", PUB, "room 1/temp")


def test_caches_are_bounded_and_do_not_change_answers(monkeypatch, fleet):
    monkeypatch.setattr(acl_module, "MAX_CACHED_DECISIONS", 8)
    monkeypatch.setattr(acl_module, "MAX_CACHED_IDENTITIES", 4)
    for round_ in range(3):
        for i in range(20):
            assert fleet.check(None, f"dev{i}", PUB, f"tele/dev{i}/t")
            assert not fleet.check(None, f"dev{i}", PUB, f"tele/dev{i + 1}/t")
    assert len(fleet._decisions) <= 8 and len(fleet._compiled) <= 4


def test_long_topics_are_decided_but_not_cached(fleet):
    topic = "tele/dev1/" + "x" * 1000
    assert fleet.check(None, "dev1", PUB, topic)
    assert all(key[3] != topic for key in fleet._decisions)


# --- filter algebra, checked exhaustively against the reference matcher --------------------------

_FILTER_LEVELS = ("a", "$s", "", "+", "#")
_TOPIC_LEVELS = ("a", "$s", "", "z")  # "z" appears in no filter: the witness for "+" and "#"


def _valid_filters(max_levels=3):
    for n in range(1, max_levels + 1):
        for levels in itertools.product(_FILTER_LEVELS, repeat=n):
            text = "/".join(levels)
            try:
                yield validate_filter(text)
            except TopicError:
                continue


FILTERS = list(_valid_filters())
TOPICS = ["/".join(levels) for n in range(1, 5) for levels in itertools.product(_TOPIC_LEVELS, repeat=n)]
TOPICS = [t for t in TOPICS if t]
MATCHED = {f: frozenset(t for t in TOPICS if matches(f, t)) for f in FILTERS}


def test_filter_covers_is_exactly_subset_of_matched_topics():
    wrong = [(r, q) for r in FILTERS for q in FILTERS if filter_covers(r, q) != (MATCHED[q] <= MATCHED[r])]
    assert not wrong, wrong[:10]


def test_filters_overlap_is_exactly_a_shared_topic():
    wrong = [(a, b) for a in FILTERS for b in FILTERS if filters_overlap(a, b) != bool(MATCHED[a] & MATCHED[b])]
    assert not wrong, wrong[:10]


@pytest.mark.parametrize(
    "rule, requested, covered",
    [
        ("a/#", "a/#", True),
        ("a/+", "a/#", False),
        ("a/#", "a", True),
        ("a/+", "a/b", True),
        ("a/b", "a/+", False),
        ("#", "$SYS/#", False),
        ("+/#", "+/+", True),
        ("$SYS/#", "$SYS/broker/+", True),
        ("+/#", "#", True),  # the empty topic does not exist, so "#" never matches zero levels
        ("+/+", "+/#", False),
    ],
)
def test_filter_covers_examples(rule, requested, covered):
    assert filter_covers(rule, requested) is covered
