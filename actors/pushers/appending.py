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
import stat
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

LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "ramfs", "overlay"}
)
"""File systems on a local disk or in memory: a small append to one of them returns in
microseconds (it lands in the page cache), unlike one to a network mount, a FUSE file system
or a FIFO, which can hang."""

INLINE_WRITE_BYTES = 256 * 1024
"""The largest append made on the event loop itself, to a regular file of a
:data:`LOCAL_FILE_SYSTEMS` type: handing a small write to a thread and back costs more CPU
(two wake-ups, the GIL handed over and back) than the write itself. A sensor's tick is a few
kilobytes; a flood's batches are larger and still go to a thread."""


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


def file_system_type(fd: int) -> str | None:
    """The type of the file system holding the file open on ``fd`` (``ext4``, ``nfs4``…),
    from the mount table of this process (``/proc/self/mountinfo``); ``None`` if unknown."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
            for line in table:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


def writes_inline(fd: int) -> bool:
    """Whether small appends to the file open on ``fd`` may be made on the event loop: a
    regular file on a :data:`LOCAL_FILE_SYSTEMS` type."""
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False
    return regular and file_system_type(fd) in LOCAL_FILE_SYSTEMS


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
