"""What network backends share: secrets read from files, and addresses safe to log."""

from __future__ import annotations

import re
from pathlib import Path

from wattflow.formats.errors import WattflowError


class SecretFileError(WattflowError):
    """A secret file that cannot be used; the message names the file, never its content."""


_CREDENTIALS_IN_URI = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<credentials>[^@/]*@)", re.I)


def redact_uri(uri: str) -> str:
    """``uri`` with any ``user:password@`` replaced, so that logs and errors never show a secret."""
    return _CREDENTIALS_IN_URI.sub(r"\g<scheme>***@", uri)


def read_secret(path: Path, what: str) -> str:
    """A secret (password, token, connection string) kept in a file, such as a mounted secret.

    Only the first line counts and surrounding whitespace is dropped, since editors and
    ``echo`` add a final newline that is not part of the secret.

    Raises:
        SecretFileError: the file cannot be read or is empty; the message names the file, never
            its content.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SecretFileError(f"{what} file {path}: {error.strerror}") from None
    lines = text.strip().splitlines()
    if not lines or not lines[0].strip():
        raise SecretFileError(f"{what} file {path} is empty")
    return lines[0].strip()
