"""Appending to files all or nothing: what the CSV and JSON Lines outputs share.

A write that fails part-way (a disk that fills mid-batch) would leave part of a batch in the
file, a line cut short, and the whole batch dead-lettered besides: the same report in both
places, and a line no reader can parse. So each batch is written with unbuffered writes, and a
failed batch is cut off again (``ftruncate`` to the size before it): a batch is in the file
whole or not at all, and retrying it, or replaying its dead letters, writes each report once.

Errors the file system or its administrator can mend (a full disk or quota, no permission, a
read-only remount, an I/O error or a stale handle on a network file system) are retried for
the output's ``--retry-for-s``, as the network outputs retry an unreachable server; errors that
say the path itself is wrong (not a directory, a directory, a name too long) are not. Before
any of that, :func:`check_output_path` stops the command at start when nothing can be written
where the output would write: at start such an error is a wrong path, not an outage.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
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


CHECK_PREFIX = ".wattflow-check-"
"""How the file made and removed at start to see that a directory takes files is named."""


def check_output_path(
    where: str, directory: Path, *, file: Path | None = None, makes_directories: bool = True
) -> None:
    """Raise a :class:`PushError` now if nothing can be written to ``file`` (or under
    ``directory``), rather than find out at the first write.

    At run time the same errors are retried for ``--retry-for-s``, since a full disk or a
    permission can be mended meanwhile; at start they are almost always a mistyped path or a
    read-only place (``/proc``, ``/sys``, a read-only mount), and a finite replay would retry
    them for five minutes before failing. So the check does what the first write would: it
    finds the directory, or the nearest existing one above it where the output would create it
    (``makes_directories``), and makes and removes a file there, which needs what making a
    directory needs (write and search permission, a file system that takes new names). It
    leaves nothing behind, so ``wattflow check`` may call it too. An existing regular ``file``
    is opened to append, as the output will; a FIFO or a device is left to the first write
    (opening one can block, or fail only while no reader is there).

    ``where`` names the output and its flag (``output 'pusher_jsonl': --file power.jsonl``).
    """
    if file is not None and file.is_dir():
        raise PushError(f"{where}: {file} is a directory")
    found = _nearest_directory(where, directory, makes_directories)
    if found is None:
        return  # not even the root exists: no file system to ask
    if file is not None and file.exists():
        if file.is_file():
            _try(
                where,
                f"cannot write to {file}",
                lambda: os.close(os.open(file, os.O_WRONLY | os.O_APPEND)),
            )
        return
    made = (
        f"cannot create the directory {directory} (in {found})"
        if found != directory
        else f"cannot create files in {directory}"
    )
    _try(where, made, lambda: _make_and_remove(found / f"{CHECK_PREFIX}{os.getpid()}"))


def _nearest_directory(where: str, directory: Path, makes_directories: bool) -> Path | None:
    """``directory``, or the nearest existing directory above it where the output would make
    it; an error when that is a file, or when the output makes no directories."""
    found = next((path for path in (directory, *directory.parents) if path.exists()), None)
    if found is None:
        return None
    if not found.is_dir():
        raise PushError(f"{where}: {found} is not a directory")
    if found != directory and not makes_directories:
        raise PushError(f"{where}: {directory} does not exist (this output does not create it)")
    return found


def _make_and_remove(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(path)


def _try(where: str, what: str, action: Callable[[], None]) -> None:
    """Run ``action``; an OSError becomes a :class:`PushError` saying ``what`` and why."""
    try:
        action()
    except OSError as error:
        raise PushError(f"{where}: {what}: {error.strerror or error}") from None


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
