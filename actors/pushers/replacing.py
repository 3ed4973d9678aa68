"""Files rewritten whole, never seen half-written: what the virtiofs and filedb outputs share.

Their files hold one value (a VM's power, the last report) that a reader polls, often from
another machine (a guest reading its virtiofs share). Rewriting such a file in place lets a
read land between the truncation and the write and see an empty or a cut file. So the new
content goes to a temporary file beside it and takes the file's name with ``rename``, which
POSIX makes atomic: a reader opens either the old file or the new one. A failed write removes
its temporary file and leaves the old content in place. There is no ``fsync``: the content is
rewritten every tick and outdated a tick later, so a flush to the disk per file and tick would
buy nothing a reader needs (ext4 and xfs flush a file renamed over another before the rename
reaches the disk anyway).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

TEMPORARY_PREFIX = ".wattflow-"
"""How the temporary files start: hidden, and named after what writes them."""


def replace_file(path: Path, data: bytes) -> None:
    """Give ``path`` the content ``data`` at once.

    Raises:
        OSError: the file could not be written; ``path`` keeps its old content.
    """
    # Named after the process and the thread: two outputs of one process (or two workers)
    # writing the same file at once each write their own temporary file.
    writer = f"{os.getpid()}.{threading.get_ident()}"
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}.{writer}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
