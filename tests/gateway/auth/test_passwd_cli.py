"""`lightgate passwd FILE USER` as operators and scripts run it: a real subprocess and a real file."""

import os
import stat
import subprocess
import sys

import pytest

from gateway.auth.passwords import PasswordFile
from tests.helpers.processes import ROOT

LIGHTGATE = [sys.executable, "-m", "gateway.app.cli"]


def passwd(cwd, *args, stdin=""):
    return subprocess.run(LIGHTGATE + ["passwd", *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_add_creates_a_private_file_and_the_password_verifies(tmp_path):
    out = passwd(tmp_path, "users", "alice", "--password-stdin", stdin="s3cret\n")
    assert out.returncode == 0, out.stderr
    assert "added user 'alice' to users" in out.stdout
    path = tmp_path / "users"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "s3cret" not in path.read_text()
    assert PasswordFile.load(path).verify("alice", b"s3cret")


@pytest.mark.slow  # several CLI processes
def test_change_keeps_other_users_and_comments(tmp_path):
    (tmp_path / "users").write_text("# managed by ops\n")
    assert passwd(tmp_path, "users", "alice", "--password-stdin", stdin="one\n").returncode == 0
    assert passwd(tmp_path, "users", "bob", "--password-stdin", stdin="two\n").returncode == 0
    out = passwd(tmp_path, "users", "alice", "--password-stdin", stdin="three\r\n")
    assert out.returncode == 0 and "changed the password of 'alice'" in out.stdout
    pw = PasswordFile.load(tmp_path / "users")
    assert pw.users == ["alice", "bob"]
    assert pw.verify("alice", "three") and not pw.verify("alice", "one") and pw.verify("bob", "two")
    assert (tmp_path / "users").read_text().startswith("# managed by ops\n")


@pytest.mark.slow  # several CLI processes
def test_delete_removes_the_user_and_unknown_users_exit_1(tmp_path):
    passwd(tmp_path, "users", "alice", "--password-stdin", stdin="a\n")
    passwd(tmp_path, "users", "bob", "--password-stdin", stdin="b\n")
    out = passwd(tmp_path, "users", "alice", "--delete")
    assert out.returncode == 0 and "removed user 'alice'" in out.stdout
    assert PasswordFile.load(tmp_path / "users").users == ["bob"]
    out = passwd(tmp_path, "users", "alice", "--delete")
    assert out.returncode == 1 and "no user 'alice'" in out.stderr


def test_delete_from_a_missing_file_exits_1(tmp_path):
    out = passwd(tmp_path, "nothing", "alice", "--delete")
    assert out.returncode == 1 and "cannot read the password file" in out.stderr
    assert not (tmp_path / "nothing").exists()


@pytest.mark.slow  # several CLI processes
def test_bad_user_name_and_empty_password_exit_1_and_change_nothing(tmp_path):
    out = passwd(tmp_path, "users", "a:b", "--password-stdin", stdin="x\n")
    assert out.returncode == 1 and "must not contain ':'" in out.stderr
    out = passwd(tmp_path, "users", "alice", "--password-stdin", stdin="\n")
    assert out.returncode == 1 and "password must not be empty" in out.stderr
    assert not (tmp_path / "users").exists()


def test_malformed_file_is_reported_with_its_line_and_left_alone(tmp_path):
    (tmp_path / "users").write_text("# ok\nalice-no-hash\n")
    out = passwd(tmp_path, "users", "bob", "--password-stdin", stdin="x\n")
    assert out.returncode == 1 and "users:2: expected 'user:hash'" in out.stderr
    assert (tmp_path / "users").read_text() == "# ok\nalice-no-hash\n"


def test_usage_errors_exit_2(tmp_path):
    assert passwd(tmp_path, "users").returncode == 2
    assert passwd(tmp_path, "users", "alice", "--delete", "--password-stdin").returncode == 2
