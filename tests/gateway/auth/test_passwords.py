"""The password file: argon2id hashes, verification, file format, errors with line numbers, atomic saves."""

import base64
import shutil
import stat
import subprocess

import pytest
from argon2 import PasswordHasher, extract_parameters

from gateway.auth.mosquitto import MosquittoHash
from gateway.auth.passwords import HASHER, PasswordFile, PasswordFileError, validate_username


MOSQUITTO_LINES = {
    "alice": ("s3cret pass", "$7$101$KkArbQFc9FqUvHKw$1V+hbniTPVVsl1OwvnleuDB/yaIrB3yXNFkDorBtmMcxXCXsMm0PEBbO"
                             "Wl0LbiDDVCxlkMerQ1ZjlMWRaSsxsA=="),
    "carol": ("pw6", "$6$ENCViWEZMwY0pCI+$mFJF9BmVkR6ffl93k2UP7ZXE5oVH6fIDrab2noFw1nKQaj7ZCAU1alSdtDc9Al2PPjTGVNnZc/5M2D0"
                     "jr7DUww=="),
}
"""Written by mosquitto 2.0.11's ``mosquitto_passwd -b`` (carol with ``-H sha512``): user -> (password, hash)."""
MOSQUITTO_SALT, MOSQUITTO_DIGEST = MOSQUITTO_LINES["alice"][1].split("$")[3:]


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


def test_mosquitto_passwd_lines_verify_as_they_are(tmp_path, alice_hash):
    """A file ``mosquitto_passwd`` wrote ($7$ PBKDF2-SHA512 and the older $6$ SHA-512), next to an argon2 line."""
    path = tmp_path / "pw"
    path.write_text("".join(f"{user}:{encoded}\n" for user, (_, encoded) in MOSQUITTO_LINES.items())
                    + f"dave:{alice_hash}\n")
    pw = PasswordFile.load(path)
    for user, (password, _) in MOSQUITTO_LINES.items():
        assert pw.verify(user, password) and pw.verify(user, password.encode()), user
        assert not pw.verify(user, password + "x") and not pw.verify(user, b"") and not pw.verify(user, None), user
    assert pw.verify("dave", "s3cret") and not pw.verify("alice", "s3cret")
    assert not pw.verify("mallory", "s3cret pass")


def test_a_mosquitto_file_keeps_its_lines_and_a_changed_password_becomes_argon2id(tmp_path):
    path = tmp_path / "pw"
    path.write_text("# from mosquitto\n" + "".join(f"{u}:{h}\n" for u, (_, h) in MOSQUITTO_LINES.items()))
    pw = PasswordFile.load(path)
    pw.set_password("alice", "new one")
    lines = pw.render().splitlines()
    assert lines[0] == "# from mosquitto" and lines[2] == f"carol:{MOSQUITTO_LINES['carol'][1]}"
    assert extract_parameters(lines[1].split(":", 1)[1]).type.name == "ID"
    assert pw.verify("alice", "new one") and pw.verify("carol", "pw6")


def test_unknown_user_of_a_mosquitto_file_is_checked_against_a_dummy_of_the_same_cost(tmp_path):
    path = tmp_path / "pw"
    path.write_text(f"alice:{MOSQUITTO_LINES['alice'][1]}\n")
    dummy = MosquittoHash.parse(PasswordFile.load(path)._dummy_hash)
    assert (dummy.iterations, len(dummy.salt)) == (101, 12) and dummy.salt != base64.b64decode(MOSQUITTO_SALT)


def test_a_file_the_real_mosquitto_passwd_writes_verifies(tmp_path):
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto_passwd is not installed (apt-get install mosquitto)")
    path = tmp_path / "pw"
    users = {"sensor-17": "päss wörd", "ops": "x" * 60}
    for i, (user, password) in enumerate(users.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(path), user, password],
                       check=True, capture_output=True, timeout=30)
    subprocess.run(["mosquitto_passwd", "-H", "sha512", "-b", str(path), "old", "from 1.6"], check=True,
                   capture_output=True, timeout=30)
    schemes = [line.split(":", 1)[1][:3] for line in path.read_text().splitlines()]
    assert schemes == ["$7$", "$7$", "$6$"]
    pw = PasswordFile.load(path)
    for user, password in {**users, "old": "from 1.6"}.items():
        assert pw.verify(user, password) and not pw.verify(user, password[:-1]), user


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
        ("alice:$5$rounds=5000$abc$def\n", ":1: the hash is not an argon2 PHC string"),
        ("alice:$7$101$abc$def\n", ":1: the salt of the mosquitto hash is not base64"),
        (f"alice:$7$0${MOSQUITTO_SALT}${MOSQUITTO_DIGEST}\n", ":1: the iterations of a mosquitto $7$ hash must be"),
        (f"alice:$7$99999999999${MOSQUITTO_SALT}${MOSQUITTO_DIGEST}\n", ":1: the iterations of a mosquitto $7$"),
        (f"alice:$7$101${MOSQUITTO_SALT}$AAAA\n", ":1: the digest of a mosquitto hash is 64 bytes (SHA-512), not 3"),
        (f"alice:$7$101$${MOSQUITTO_DIGEST}\n", ":1: the salt of the mosquitto hash is empty"),
        ("alice:$6$a$b$c\n", ":1: a mosquitto $6$ hash is $6$<base64 salt>$<base64 hash>"),
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
