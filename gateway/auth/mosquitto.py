"""Mosquitto's password hashes, as ``mosquitto_passwd`` writes them, so a Mosquitto user brings their file as it is.

Two formats (mosquitto's src/password_mosq.c)::

    $7$<iterations>$<base64 salt>$<base64 hash>   PBKDF2-HMAC-SHA512 (mosquitto 2.0's default: 101 iterations,
                                                  a 12-byte salt, a 64-byte hash)
    $6$<base64 salt>$<base64 hash>                SHA-512 of the password then the salt (mosquitto 1.6 and before)

Both cost far less than argon2id to guess (101 PBKDF2 rounds is ~0.1 ms), so
``lightgate passwd`` re-hashes a user with argon2id when their password is set
again; the file verifies both meanwhile.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import final

__all__ = ["MAX_ITERATIONS", "MosquittoHash", "is_mosquitto_hash"]

MAX_ITERATIONS = 10_000_000
"""The most PBKDF2 iterations a ``$7$`` line may ask for: ~5 s of CPU per check here, beyond any sane setting
(mosquitto's default is 101, OWASP's 210,000); a typo of more would stall every CONNECT of that user."""

SHA512_SIZE = 64
"""Bytes of a SHA-512 digest: what both formats store as the hash."""

_PREFIXES = ("$7$", "$6$")


def is_mosquitto_hash(encoded: str) -> bool:
    """True when ``encoded`` claims one of mosquitto's formats (it may still be malformed: :meth:`MosquittoHash.parse`
    says why)."""
    return encoded.startswith(_PREFIXES)


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError(f"the {what} of the mosquitto hash is not base64") from None


@final
@dataclass(frozen=True, slots=True)
class MosquittoHash:
    """One parsed mosquitto hash; ``iterations`` is 0 for the old ``$6$`` format (one SHA-512, no PBKDF2)."""

    iterations: int
    salt: bytes
    digest: bytes

    @classmethod
    def parse(cls, encoded: str) -> MosquittoHash:
        """Parse a ``$7$`` or ``$6$`` line's hash.

        Raises:
            ValueError: not one of the two formats, an iteration count that is
                not 1..MAX_ITERATIONS, bad base64, an empty salt or a hash that
                is not 64 bytes (the message says which).
        """
        if encoded.startswith("$7$"):
            parts = encoded.split("$")
            if len(parts) != 5:
                raise ValueError("a mosquitto $7$ hash is $7$<iterations>$<base64 salt>$<base64 hash>")
            _, _, iterations, salt, digest = parts
            if not iterations.isdigit() or not 1 <= int(iterations) <= MAX_ITERATIONS:
                raise ValueError(f"the iterations of a mosquitto $7$ hash must be 1..{MAX_ITERATIONS}, "
                                 f"not {iterations[:20]!r}")
            rounds = int(iterations)
        elif encoded.startswith("$6$"):
            parts = encoded.split("$")
            if len(parts) != 4:
                raise ValueError("a mosquitto $6$ hash is $6$<base64 salt>$<base64 hash>")
            _, _, salt, digest = parts
            rounds = 0
        else:
            raise ValueError("not a mosquitto hash ($7$... or $6$...)")
        parsed = cls(rounds, _b64(salt, "salt"), _b64(digest, "digest"))
        if not parsed.salt:
            raise ValueError("the salt of the mosquitto hash is empty")
        if len(parsed.digest) != SHA512_SIZE:
            raise ValueError(f"the digest of a mosquitto hash is {SHA512_SIZE} bytes (SHA-512), "
                             f"not {len(parsed.digest)}")
        return parsed

    def verify(self, password: bytes) -> bool:
        """True when ``password`` hashes to this digest; compared in constant time."""
        if self.iterations:
            computed = hashlib.pbkdf2_hmac("sha512", password, self.salt, self.iterations)
        else:
            computed = hashlib.sha512(password + self.salt).digest()
        return hmac.compare_digest(computed, self.digest)

    def encode(self) -> str:
        """The hash as ``mosquitto_passwd`` writes it."""
        salt, digest = base64.b64encode(self.salt).decode(), base64.b64encode(self.digest).decode()
        return f"$7${self.iterations}${salt}${digest}" if self.iterations else f"$6${salt}${digest}"

    def dummy(self) -> MosquittoHash:
        """A hash of a random secret with this one's format and cost: what an unknown user is checked against."""
        return MosquittoHash(self.iterations, secrets.token_bytes(len(self.salt)), secrets.token_bytes(SHA512_SIZE))
