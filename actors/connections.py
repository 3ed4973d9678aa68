"""What network backends share: secrets read from files, and addresses safe to log."""

from __future__ import annotations

import re
from pathlib import Path

from wattflow.formats.errors import WattflowError


class SecretFileError(WattflowError):
    """A secret file that cannot be used; the message names the file, never its content."""


_CREDENTIALS = re.compile(r"(?P<start>^|[\s'\"/(,])[^\s'\"/(,@]+@")


def redact_uri(text: str) -> str:
    """``text`` with every ``user:password@`` replaced by ``***@``.

    It applies to any text that may hold a connection string (an error from a driver, a
    malformed string), not only to well-formed URIs, so that logs never show a secret.
    """
    return _CREDENTIALS.sub(r"\g<start>***@", text)


def describe_driver_error(error: BaseException) -> str:
    """A database driver's error in one short line, without secrets.

    pymongo's server-selection errors end with the whole topology description and repeat the
    socket timeouts; what a user needs is the first part: which server, and why.
    """
    text = redact_uri(str(error)).split(", Timeout:")[0]
    return re.sub(r" \(configured timeouts: [^)]*\)", "", text)


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
