"""Appending to files all or nothing: what the CSV and JSON Lines outputs share.

A write that fails part-way (a disk that fills mid-batch) would leave part of a batch in the
file, a line cut short, and the whole batch dead-lettered besides: the same report in both
places, and a line no reader can parse. So each batch is written with unbuffered writes, and a
failed batch is cut off again (``ftruncate`` to the size before it): a batch is in the file
whole or not at all, and retrying it, or replaying its dead letters, writes each report once.

Errors the file system or its administrator can mend (a full disk or quota, no permission, a
read-only remount, an I/O error or a stale handle on a network file system) are retried for
the output's ``--retry-for-s``, as the network outputs retry an unreachable server; errors that
say the path itself is wrong (not a directory, a directory, a name too long) are not.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from wattflow.actors.errors import PushError, PushUnavailable

logger = logging.getLogger(__name__)

WRONG_PATH = frozenset(
    {
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EINVAL,
        errno.EFBIG,
    }
)
"""Errors that say the path cannot hold the output whatever happens meanwhile: not retried."""


def file_error(output: str, error: OSError, path: Path | None = None) -> PushError:
    """The error of a failed file write: retryable unless :data:`WRONG_PATH` says otherwise;
    it names the output and the file."""
    where = error.filename if error.filename is not None else path
    reason = error.strerror or str(error)
    message = f"output '{output}': {where}: {reason}" if where else f"output '{output}': {reason}"
    if error.errno in WRONG_PATH:
        return PushError(message)
    return PushUnavailable(message)


def append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the end of the file open on ``fd`` (opened to append)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def start_on_a_new_line(fd: int, path: Path) -> None:
    """End a last line left unfinished (a writer killed mid-line), so that the next line
    written starts on a line of its own instead of being glued to the broken one."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        logger.warning("%s does not end with a line break (a write cut short?); adding one", path)
        append(fd, b"\n")


def take_back(sizes: dict[Path, int]) -> None:
    """Cut each file back to the size it had before the batch; a file that cannot be cut is
    logged, since it now holds part of a batch that also goes to the dead letters."""
    for path, size in sizes.items():
        try:
            os.truncate(path, size)
        except OSError as error:
            logger.error(
                "%s: could not remove the part of a failed batch written to it (%s); those "
                "reports are both in the file and in the dead letters",
                path,
                error.strerror or error,
            )
