"""Authenticator: credentials, anonymous policy, brute-force delay per source, password-file reloads."""

import argparse
import os
import threading

import pytest

from gateway.auth import authn
from gateway.app import config as cfg
from gateway.auth.acl import Access, Acl
from gateway.auth.authn import Authenticator, ReloadError, WatchedFile, anonymous_allowed
from gateway.auth.passwords import PasswordFile, PasswordFileError
from gateway.mqtt.reasons import ReasonCode


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def pwfile(tmp_path):
    path = tmp_path / "passwd"
    pw = PasswordFile.load_or_empty(path)
    pw.set_password("alice", "s3cret")
    pw.save()
    return path


def make(pwfile, clock=None, **kw):
    kw.setdefault("allow_anonymous", False)
    return Authenticator(WatchedFile(pwfile, PasswordFile.load), clock=clock or Clock(), **kw)


def test_right_credentials_are_accepted_with_the_user_name(pwfile):
    decision = make(pwfile).authenticate("alice", b"s3cret", "10.0.0.1")
    assert decision.accepted and decision.reason is ReasonCode.SUCCESS
    assert decision.username == "alice" and decision.delay_s == 0


def test_wrong_password_and_unknown_user_get_the_same_answer(pwfile):
    auth = make(pwfile)
    wrong_password = auth.authenticate("alice", b"nope", "10.0.0.1")
    unknown_user = auth.authenticate("mallory", b"s3cret", "10.0.0.2")
    no_password = auth.authenticate("alice", None, "10.0.0.3")
    for decision in (wrong_password, unknown_user, no_password):
        assert not decision.accepted and decision.username is None
        assert decision.reason is ReasonCode.BAD_USER_NAME_OR_PASSWORD
    assert wrong_password.why == unknown_user.why == no_password.why  # even the log line does not tell
    assert wrong_password.delay_s == unknown_user.delay_s == no_password.delay_s == 1.0


def test_anonymous_refused_when_off_and_accepted_when_on(pwfile):
    refused = make(pwfile, allow_anonymous=False).authenticate(None, None, "h")
    assert not refused.accepted and refused.reason is ReasonCode.NOT_AUTHORIZED and refused.delay_s == 1.0
    accepted = make(pwfile, allow_anonymous=True).authenticate(None, None, "h")
    assert accepted.accepted and accepted.username is None


def test_with_anonymous_on_a_wrong_password_is_still_refused(pwfile):
    decision = make(pwfile, allow_anonymous=True).authenticate("alice", b"guess", "h")
    assert not decision.accepted and decision.reason is ReasonCode.BAD_USER_NAME_OR_PASSWORD


def test_without_a_password_file_user_names_are_not_identities():
    open_door = Authenticator(None, allow_anonymous=True).authenticate("admin", b"whatever", "h")
    assert open_door.accepted and open_door.username is None  # ACL user sections must not apply to a claim
    closed = Authenticator(None, allow_anonymous=False, clock=Clock()).authenticate("admin", b"x", "h")
    assert not closed.accepted and closed.reason is ReasonCode.BAD_USER_NAME_OR_PASSWORD


def test_delay_doubles_per_failure_of_a_source_up_to_the_cap(pwfile):
    auth = make(pwfile)
    delays = [auth.authenticate("alice", b"x", "10.0.0.9").delay_s for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert auth.authenticate("alice", b"x", "10.0.0.10").delay_s == 1.0  # another source starts fresh
    assert auth.failures("10.0.0.9") == 6


def test_success_does_not_wait_even_after_failures(pwfile):
    auth = make(pwfile)
    for _ in range(3):
        auth.authenticate("alice", b"x", "nat")
    assert auth.authenticate("alice", b"s3cret", "nat").delay_s == 0


def test_failures_are_forgotten_after_a_quiet_minute(pwfile):
    clock = Clock()
    auth = make(pwfile, clock)
    for _ in range(3):
        auth.authenticate("bob", b"x", "h")
    clock.now += authn.FAILURE_MEMORY_S + 1
    assert auth.failures("h") == 0
    assert auth.authenticate("bob", b"x", "h").delay_s == 1.0


def test_configured_delay_and_zero_disables(pwfile):
    assert make(pwfile, failure_delay_s=0.25).authenticate("a", b"x", "h").delay_s == 0.25
    auth = make(pwfile, failure_delay_s=0.0)
    assert [auth.authenticate("a", b"x", "h").delay_s for _ in range(3)] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="must not be negative"):
        make(pwfile, failure_delay_s=-1)


def test_tracked_sources_are_bounded(pwfile, monkeypatch):
    monkeypatch.setattr(authn, "MAX_TRACKED_SOURCES", 3)
    auth = make(pwfile, failure_delay_s=0.0)
    for i in range(10):
        auth.authenticate(None, None, f"10.0.0.{i}")
    assert len(auth._failures) == 3
    assert auth.failures("10.0.0.0") == 0 and auth.failures("10.0.0.9") == 1


def test_concurrent_failures_from_one_source_are_all_counted(pwfile):
    auth = make(pwfile, failure_delay_s=0.0)
    threads = [threading.Thread(target=lambda: auth.authenticate(None, None, "h")) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert auth.failures("h") == 8


@pytest.mark.parametrize(
    "setting, has_file, allowed",
    [("auto", False, True), ("auto", True, False), ("true", True, True), ("false", False, False)],
)
def test_anonymous_setting(setting, has_file, allowed):
    assert anonymous_allowed(setting, has_file) is allowed


def test_anonymous_setting_rejects_other_words():
    with pytest.raises(ValueError, match="auto, true or false"):
        anonymous_allowed("maybe", False)


def _conf(tmp_path, toml):
    path = tmp_path / "lg.toml"
    path.write_text(toml)
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.resolve(parser.parse_args(["--config", str(path)]))


def test_from_config_password_file_turns_anonymous_off_unless_allowed(tmp_path, pwfile):
    auth = Authenticator.from_config(_conf(tmp_path, f'[auth]\npassword_file = "{pwfile}"\n'))
    assert not auth.allow_anonymous and auth.failure_delay_s == 1.0
    assert auth.authenticate("alice", b"s3cret", "h").accepted
    auth = Authenticator.from_config(
        _conf(tmp_path, f'[auth]\npassword_file = "{pwfile}"\nallow_anonymous = true\nfailure_delay_s = 2.5\n'))
    assert auth.allow_anonymous and auth.failure_delay_s == 2.5
    assert Authenticator.from_config(_conf(tmp_path, "")).allow_anonymous
    assert not Authenticator.from_config(_conf(tmp_path, '[auth]\nallow_anonymous = "false"\n')).allow_anonymous


def test_from_config_with_a_missing_password_file_fails_clearly(tmp_path):
    with pytest.raises(PasswordFileError, match="cannot read the password file"):
        Authenticator.from_config(_conf(tmp_path, f'[auth]\npassword_file = "{tmp_path / "none"}"\n'))


def test_bad_anonymous_setting_in_the_file_is_a_config_error(tmp_path):
    with pytest.raises(cfg.ConfigError, match="auth.allow_anonymous must be one of auto, true, false"):
        _conf(tmp_path, '[auth]\nallow_anonymous = "sometimes"\n')


# --- reloads ----------------------------------------------------------------------------------------


def test_reload_picks_up_a_new_user_after_lightgate_passwd_style_save(pwfile):
    auth = make(pwfile)
    assert not auth.authenticate("bob", b"pw", "h").accepted
    assert auth.reload_if_changed() is False
    pw = PasswordFile.load(pwfile)
    pw.set_password("bob", "pw")
    pw.save()
    assert auth.reload_if_changed() is True
    assert auth.authenticate("bob", b"pw", "h").accepted
    assert auth.reload_if_changed() is False


def test_broken_edit_keeps_the_old_users_and_is_reported_once(pwfile):
    auth = make(pwfile)
    text = pwfile.read_text()
    pwfile.write_text(text + "broken line\n")
    with pytest.raises(ReloadError, match=r":2: expected 'user:hash'.*keeping the version loaded before"):
        auth.reload_if_changed()
    assert auth.reload_if_changed() is False  # same broken file: not reported again
    assert auth.authenticate("alice", b"s3cret", "h").accepted
    pwfile.write_text(text)
    assert auth.reload_if_changed() is True  # the fix changes the size back


def test_removed_file_keeps_the_old_version(pwfile):
    watched = WatchedFile(pwfile, PasswordFile.load)
    pwfile.unlink()
    with pytest.raises(ReloadError, match="the file is gone"):
        watched.refresh()
    assert watched.refresh() is False
    assert watched.value.verify("alice", "s3cret")


def test_watched_file_works_for_acl_files_too(tmp_path):
    path = tmp_path / "a.acl"
    path.write_text("user u\nallow publish a\n")
    watched = WatchedFile(path, Acl.load)
    assert not watched.value.check("u", "c", Access.PUBLISH, "b")
    path.write_text("user u\nallow publish b\n")  # same size, same inode: only the mtime tells
    os.utime(path, ns=(5, 5))  # the two writes may share one coarse mtime tick; make the change visible
    assert watched.refresh() and watched.value.check("u", "c", Access.PUBLISH, "b")
