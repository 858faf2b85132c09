"""The password file: one ``user:hash`` line per user, argon2id hashes, atomic saves.

The file is the operator's, so it is edited in place rather than rewritten
from scratch: comments and the order of users survive ``lightgate passwd``.
Hashes are argon2 PHC strings (``$argon2id$v=19$m=...,t=...,p=...$salt$hash``),
so each carries its own salt and cost parameters and old entries keep
verifying after the defaults change. Lines ``mosquitto_passwd`` wrote
(``$7$`` PBKDF2-SHA512, ``$6$`` SHA-512; gateway/auth/mosquitto.py) verify as
they are, so a Mosquitto user's file works unchanged; ``lightgate passwd``
writes argon2id.

Format::

    # comments and blank lines are kept as they are
    alice:$argon2id$v=19$m=19456,t=2,p=1$...$...
    sensor-17:$argon2id$v=19$m=19456,t=2,p=1$...$...
    bob:$7$101$...$...

Verification costs one hash computation whether or not the user exists (an
unknown user is checked against a dummy hash with the scheme and parameters
of the file's first user), so in a file of one scheme the time taken does not
tell a client which of the two was wrong.
"""

from __future__ import annotations

import os
import secrets
import unicodedata
from functools import cached_property
from pathlib import Path

from argon2 import PasswordHasher, extract_parameters
from argon2.exceptions import InvalidHashError, VerificationError

from gateway.auth.mosquitto import MosquittoHash, is_mosquitto_hash

__all__ = ["HASHER", "PasswordFile", "PasswordFileError", "validate_username"]

HASHER = PasswordHasher(time_cost=2, memory_cost=19 * 1024, parallelism=1)
"""argon2id with OWASP's first recommended setting (19 MiB, 2 passes, 1 lane).

argon2-cffi's defaults (64 MiB, 3 passes, 4 lanes) cost ~250 ms per verify on
this 2-core machine: a reconnect storm of 1000 devices would need minutes of
CPU. 19 MiB x 2 passes costs ~45 ms (the ~50 ms budget) while keeping GPU
guessing memory-bound; one lane keeps each verify on one core so concurrent
CONNECTs do not fight over both.
"""


_LINE_BREAKING_CATEGORIES = frozenset({"Cc", "Zl", "Zp"})
"""Control characters (C0, DEL, C1 such as NEL) and U+2028/U+2029: each could split or hide a line of the file."""


class PasswordFileError(ValueError):
    """The password file cannot be read or is malformed; the message names the file and line."""


def validate_username(name: str) -> str:
    """Check that a user name can be stored in the password file; return it unchanged.

    Raises:
        ValueError: empty, contains ``:``, a control character or a line
            break, starts with ``#``, or has leading or trailing whitespace.
    """
    if not name:
        raise ValueError("user name must not be empty")
    if ":" in name:
        raise ValueError(f"user name {name!r} must not contain ':' (it separates the name from the hash)")
    bad = next((c for c in name if unicodedata.category(c) in _LINE_BREAKING_CATEGORIES), None)
    if bad is not None:
        raise ValueError(f"user name {name!r} must not contain control characters or line breaks such as {bad!r}")
    if name.startswith("#"):
        raise ValueError(f"user name {name!r} must not start with '#' (that line would be a comment)")
    if name != name.strip():
        raise ValueError(f"user name {name!r} must not start or end with whitespace")
    return name


def _check_hash(encoded: str) -> None:
    """Raise ValueError unless ``encoded`` is an argon2 PHC string argon2-cffi can verify against, or a well-formed
    mosquitto_passwd hash."""
    if is_mosquitto_hash(encoded):
        MosquittoHash.parse(encoded)
        return
    try:
        extract_parameters(encoded)
    except InvalidHashError:
        raise ValueError("the hash is not an argon2 PHC string ($argon2id$v=19$m=...,t=...,p=...$salt$hash) "
                         "nor a mosquitto_passwd one ($7$... or $6$...)") from None


def _verify(encoded: str, password: str | bytes) -> bool:
    """True when ``password`` matches ``encoded`` (a hash :func:`_check_hash` accepted)."""
    if is_mosquitto_hash(encoded):
        return MosquittoHash.parse(encoded).verify(password.encode() if isinstance(password, str) else password)
    try:
        return HASHER.verify(encoded, password)
    except (VerificationError, InvalidHashError):
        return False


class PasswordFile:
    """The users of one password file, with the file's comments and order kept for saving.

    Not thread-safe for changes; ``verify`` only reads and may run in worker
    threads (argon2 releases the GIL while it hashes).
    """

    def __init__(self, path: Path, layout: list[tuple[str | None, str]] | None = None,
                 hashes: dict[str, str] | None = None) -> None:
        """Use :meth:`load` or :meth:`load_or_empty`; this takes already-validated content.

        ``layout`` is the file's lines in order: ``(None, text)`` for a kept
        comment or blank line, ``(user, "")`` for the line of a user.
        """
        self.path = Path(path)
        self._layout = layout if layout is not None else []
        self._hashes = hashes if hashes is not None else {}

    @classmethod
    def load(cls, path: Path | str) -> PasswordFile:
        """Read and validate a password file.

        Raises:
            PasswordFileError: the file cannot be read, or a line is malformed
                (the message says ``path:line: why``).
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PasswordFileError(f"{path}: cannot read the password file: {exc}") from None
        layout: list[tuple[str | None, str]] = []
        hashes: dict[str, str] = {}
        first_seen: dict[str, int] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                layout.append((None, line))
                continue
            user, sep, encoded = stripped.partition(":")
            if not sep:
                raise PasswordFileError(f"{path}:{number}: expected 'user:hash', found no ':'")
            try:
                validate_username(user)
                _check_hash(encoded)
            except ValueError as exc:
                raise PasswordFileError(f"{path}:{number}: {exc}") from None
            if user in first_seen:
                raise PasswordFileError(f"{path}:{number}: user {user!r} is already defined on line {first_seen[user]}")
            first_seen[user] = number
            hashes[user] = encoded
            layout.append((user, ""))
        result = cls(path, layout, hashes)
        if hashes:
            result._dummy_hash  # noqa: B018 - computed now so the first unknown user is not slower than the rest
        return result

    @classmethod
    def load_or_empty(cls, path: Path | str) -> PasswordFile:
        """Like :meth:`load`, but a missing file is an empty one (``lightgate passwd`` creates it)."""
        if not Path(path).exists():
            return cls(Path(path))
        return cls.load(path)

    def __contains__(self, user: object) -> bool:
        return user in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    @property
    def users(self) -> list[str]:
        """User names in file order."""
        return list(self._hashes)

    def set_password(self, user: str, password: str | bytes) -> bool:
        """Hash ``password`` with :data:`HASHER` and store it for ``user``; True if the user is new.

        Raises:
            ValueError: invalid user name, or an empty password.
        """
        validate_username(user)
        if not password:
            raise ValueError("password must not be empty")
        new = user not in self._hashes
        self._hashes[user] = HASHER.hash(password)
        if new:
            self._layout.append((user, ""))
        return new

    def remove(self, user: str) -> None:
        """Remove ``user``.

        Raises:
            KeyError: no such user (the message names it).
        """
        if user not in self._hashes:
            raise KeyError(f"no user {user!r} in {self.path}")
        del self._hashes[user]
        self._layout.remove((user, ""))

    def verify(self, user: str | None, password: str | bytes | None) -> bool:
        """True when ``user`` exists and ``password`` is theirs.

        Always runs one verification, against a dummy hash when the user is
        unknown or no password was given, so a wrong user name and a wrong
        password take the same time.
        """
        encoded = self._hashes.get(user) if user is not None else None
        candidate = password if password is not None else b""
        if encoded is None or password is None:
            encoded, known = self._dummy_hash, False
        else:
            known = True
        return _verify(encoded, candidate) and known

    @cached_property
    def _dummy_hash(self) -> str:
        """A hash of a random secret, with the scheme and cost of this file's first hash (or :data:`HASHER`'s when
        empty)."""
        first = next(iter(self._hashes.values()), None)
        if first is not None and is_mosquitto_hash(first):
            return MosquittoHash.parse(first).dummy().encode()
        hasher = HASHER if first is None else PasswordHasher.from_parameters(extract_parameters(first))
        return hasher.hash(secrets.token_bytes(32))

    def render(self) -> str:
        """The file's text: kept comments and blank lines, one ``user:hash`` line per user."""
        return "".join((text if user is None else f"{user}:{self._hashes[user]}") + "\n"
                       for user, text in self._layout)

    def save(self) -> None:
        """Write the file atomically with mode 0600: a temporary file, fsync, rename, fsync of the directory.

        Readers (the node's reload) see the old file or the new one, never a
        partial one, and a crash leaves one of the two.

        Raises:
            PasswordFileError: the file or its directory cannot be written; the
                old file is then unchanged.
        """
        directory = self.path.parent
        tmp = directory / f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(self.render())
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise PasswordFileError(f"{self.path}: cannot write the password file: {exc}") from None
