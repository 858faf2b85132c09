"""The password file: argon2id hashes, verification, file format, errors with line numbers, atomic saves."""

import stat

import pytest
from argon2 import PasswordHasher, extract_parameters

from gateway.auth.passwords import HASHER, PasswordFile, PasswordFileError, validate_username


@pytest.fixture(scope="module")
def alice_hash():
    return HASHER.hash("s3cret")


def test_set_password_then_verify(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    assert pw.set_password("alice", "s3cret") is True
    assert pw.verify("alice", "s3cret")
    assert pw.verify("alice", b"s3cret")  # MQTT passwords are bytes; UTF-8 of the typed text matches


def test_wrong_password_unknown_user_and_missing_password_all_fail(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    pw.set_password("alice", "s3cret")
    assert not pw.verify("alice", "S3cret")
    assert not pw.verify("alice", b"")
    assert not pw.verify("alice", None)
    assert not pw.verify("mallory", "s3cret")
    assert not pw.verify(None, "s3cret")
    assert not pw.verify("", "s3cret")


def test_unknown_user_is_checked_against_a_dummy_hash_with_the_files_parameters(tmp_path):
    """Same cost for unknown users: the dummy hash is a real argon2 hash with the file's parameters."""
    slow = PasswordHasher(time_cost=3, memory_cost=8 * 1024, parallelism=1)
    path = tmp_path / "pw"
    path.write_text(f"old:{slow.hash('x')}\n")
    pw = PasswordFile.load(path)
    assert extract_parameters(pw._dummy_hash) == extract_parameters(slow.hash("y"))


def test_hashes_are_salted_argon2id_with_the_chosen_cost(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    pw.set_password("a", "same")
    pw.set_password("b", "same")
    lines = dict(line.split(":", 1) for line in pw.render().splitlines())
    assert lines["a"] != lines["b"]
    params = extract_parameters(lines["a"])
    assert (params.type.name, params.time_cost, params.memory_cost, params.parallelism) == ("ID", 2, 19456, 1)


def test_save_is_mode_0600_and_round_trips(tmp_path):
    path = tmp_path / "pw"
    pw = PasswordFile.load_or_empty(path)
    pw.set_password("alice", "one")
    pw.set_password("bob", "two")
    pw.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = PasswordFile.load(path)
    assert again.users == ["alice", "bob"]
    assert again.verify("bob", "two") and not again.verify("bob", "one")
    assert [p.name for p in tmp_path.iterdir()] == ["pw"]  # no temporary file left behind


def test_save_replaces_a_world_readable_file_with_a_private_one(tmp_path, alice_hash):
    path = tmp_path / "pw"
    path.write_text(f"alice:{alice_hash}\n")
    path.chmod(0o644)
    pw = PasswordFile.load(path)
    pw.set_password("bob", "x")
    pw.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_comments_order_and_blank_lines_survive_a_change(tmp_path, alice_hash):
    path = tmp_path / "pw"
    path.write_text(f"# fleet users\n\nalice:{alice_hash}\n  # devices below\nbob:{alice_hash}\n")
    pw = PasswordFile.load(path)
    pw.set_password("alice", "new")
    pw.set_password("carol", "c")
    pw.remove("bob")
    pw.save()
    lines = path.read_text().splitlines()
    assert lines[:2] == ["# fleet users", ""]
    assert lines[2].startswith("alice:$argon2id$") and lines[2] != f"alice:{alice_hash}"
    assert lines[3] == "  # devices below"
    assert lines[4].startswith("carol:$argon2id$") and len(lines) == 5
    assert PasswordFile.load(path).verify("alice", "new")


def test_change_password_replaces_the_old_one(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    assert pw.set_password("alice", "old") is True
    assert pw.set_password("alice", "new") is False
    assert pw.verify("alice", "new") and not pw.verify("alice", "old")
    assert len(pw) == 1


def test_remove_unknown_user_names_it(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    with pytest.raises(KeyError, match="no user 'ghost'"):
        pw.remove("ghost")


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "must not be empty"),
        ("a:b", "must not contain ':'"),
        ("a\nb", "control characters"),
        ("a\rb", "control characters"),
        ("a\x85b", "control characters"),  # NEL: str.splitlines() would split the line there
        ("a\u2028b", "control characters"),
        ("a\tb", "control characters"),
        ("#admin", "must not start with '#'"),
        (" alice", "whitespace"),
        ("alice ", "whitespace"),
    ],
)
def test_bad_user_names_are_refused_with_the_reason(tmp_path, name, message):
    with pytest.raises(ValueError, match=message):
        validate_username(name)
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    with pytest.raises(ValueError, match=message):
        pw.set_password(name, "x")
    assert len(pw) == 0


def test_names_with_spaces_inside_and_unicode_are_fine():
    assert validate_username("ops team") == "ops team"
    assert validate_username("usine-Ørsted") == "usine-Ørsted"


def test_empty_password_is_refused(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "pw")
    with pytest.raises(ValueError, match="password must not be empty"):
        pw.set_password("alice", "")


@pytest.mark.parametrize(
    "body, message",
    [
        ("# ok\nalice\n", ":2: expected 'user:hash', found no ':'"),
        ("alice:plaintext\n", ":1: the hash is not an argon2 PHC string"),
        ("alice:$7$101$abc$def\n", ":1: the hash is not an argon2 PHC string"),
        ("\n\n:{h}\n", ":3: user name must not be empty"),
        ("alice:{h}\nbob:{h}\nalice:{h}\n", ":3: user 'alice' is already defined on line 1"),
    ],
)
def test_malformed_files_name_the_line(tmp_path, alice_hash, body, message):
    path = tmp_path / "pw"
    path.write_text(body.replace("{h}", alice_hash))
    with pytest.raises(PasswordFileError) as info:
        PasswordFile.load(path)
    assert str(info.value).startswith(str(path) + ":")
    assert message in str(info.value)


def test_missing_file_is_an_error_for_load_but_empty_for_load_or_empty(tmp_path):
    with pytest.raises(PasswordFileError, match="cannot read the password file"):
        PasswordFile.load(tmp_path / "nope")
    assert len(PasswordFile.load_or_empty(tmp_path / "nope")) == 0


def test_failed_replace_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "pw"
    (target / "inside").mkdir(parents=True)  # a non-empty directory where the file should go: rename fails
    pw = PasswordFile.load_or_empty(tmp_path / "other")
    pw.path = target
    pw.set_password("alice", "x")
    with pytest.raises(PasswordFileError, match="cannot write the password file"):
        pw.save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pw"]
    assert [p.name for p in target.iterdir()] == ["inside"]


def test_failed_save_into_a_missing_directory_is_a_clear_error(tmp_path):
    pw = PasswordFile.load_or_empty(tmp_path / "no" / "such" / "dir" / "pw")
    pw.set_password("alice", "x")
    with pytest.raises(PasswordFileError, match="cannot write the password file"):
        pw.save()
