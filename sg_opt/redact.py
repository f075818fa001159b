"""Secrets out of everything sg-opt shows or stores: API keys in server text, credentials in URLs.

An endpoint URL may carry a secret (``https://user:token@host/v1``, ``?api-key=...``). What is
stored (run.json) keeps the URL with its secrets blanked; a resumed run gets the real URL again
from ``--base-url`` or ``OPENAI_BASE_URL``, matched against the stored one.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from targets.protocol import ConfigError

BLANK = "***"
SECRET_PARAM = re.compile(r"(?i)key|token|secret|sig|password|passwd|auth|credential|code")


class Redactor:
    """Blanks the API key and anything shaped like a key or bearer token out of server text."""

    PATTERNS = (re.compile(r"\bsk-[A-Za-z0-9_\-*.]{3,}"), re.compile(r"(?i)bearer\s+\S+"))

    def __init__(self, secret: str):
        self._secret = secret if len(secret) >= 8 else ""

    def __call__(self, text: str) -> str:
        if self._secret:
            text = text.replace(self._secret, BLANK)
        for pattern in self.PATTERNS:
            text = pattern.sub(BLANK, text)
        return text

    def __repr__(self) -> str:
        return "Redactor(***)"


def public_url(url: str) -> str:
    """``url`` without user:password or query, safe to show in a message."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_url(url: str | None) -> str | None:
    """``url`` with its credentials and secret-looking query values blanked, the rest kept (safe to store)."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{BLANK}@{netloc.rsplit('@', 1)[1]}"
    query = urlencode([(name, BLANK if SECRET_PARAM.search(name) else value)
                       for name, value in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment and BLANK))


def restore_url(stored: str | None, *given: str | None) -> str | None:
    """The URL to use for a run whose stored URL is ``stored``: itself when it held no secret, else the first
    of ``given`` that redacts to it; None when none does."""
    if stored is None or BLANK not in stored:
        return stored
    return next((url for url in given if url and redact_url(url) == stored), None)


def resolve_base_url(stored: str | None, given: str | None = None) -> str | None:
    """The endpoint of a run whose request stores ``stored``: the URL given now (--base-url with --resume, or
    OPENAI_BASE_URL) where the stored one had its credentials blanked; ConfigError when none given matches."""
    url = restore_url(stored, given, os.environ.get("OPENAI_BASE_URL"))
    if stored is not None and url is None:
        raise ConfigError(f"this run's --base-url {stored} held credentials, which are not stored: pass the same "
                          f"--base-url with --resume (or set OPENAI_BASE_URL to it)")
    return url
