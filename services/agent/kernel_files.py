"""Where a device agent keeps the files its sandboxed kernel process reads and writes.

A server names nothing on the agent's disk: a kernel or model library is saved under a
name the agent makes (`local_file_name`: an id and a known suffix), task data under its
checked sha256 (services/agent/files.py). `KernelFiles` puts them where the kernel
process's user can reach them, readable by that user's group only.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

from tunefarm.cuda import CUDA_KERNEL_SUFFIX

LOADABLE_SUFFIXES = (CUDA_KERNEL_SUFFIX, ".tar", ".so")
"""What a kernel or model library file may end with (the runner picks its loader by it);
the file is saved under a name the agent makes, with this suffix."""


def local_file_name(server_name: str, stem: str) -> str | None:
    """The name a kernel or library is saved under: `stem` (made here) and the suffix of
    the server's name (the runner picks the loader by it); None when that suffix is none
    of `LOADABLE_SUFFIXES`. Nothing else of the server's name is used."""
    suffix = next((x for x in LOADABLE_SUFFIXES if server_name.endswith(x)), None)
    return f"{stem}{suffix}" if suffix is not None else None


class KernelFiles:
    """Where the agent puts what the sandboxed kernel process reads and writes (leases'
    kernels, the task data cache, model runs), and with which rights.

    When kernels run as another user (an agent running as root: `--kernel-user`), that
    user's group gets read access to these files and write access to each lease's and
    model run's own directory; nobody else does. Its files must be reachable by that
    user: the work directory, unless one of its parents is closed to it (/root, a
    private temporary directory), then a private directory of the agent's own under
    the system's temporary directory (removed when the agent stops; the task data cache
    then lasts as long as the agent)."""

    def __init__(self, root: Path, gid: int | None, temporary: bool = False):
        self.root = root
        self.gid = gid  # the kernel user's group; None: kernels run as the agent's user
        self.temporary = temporary

    @classmethod
    def prepare(cls, work: Path, user: str | None) -> KernelFiles:
        if user is None or os.geteuid() != 0:
            return cls(work, None)
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            return cls(work, None)  # the runner stays root and says so
        if _reachable(work, pw.pw_uid, pw.pw_gid):
            files = cls(work, pw.pw_gid)
        else:
            files = cls(Path(tempfile.mkdtemp(prefix="tunefarm-agent-")), pw.pw_gid, temporary=True)
        files.share_dir(files.root)
        return files

    def describe(self) -> str:
        where = "under the work directory" if not self.temporary else f"in {self.root} (the work directory is closed to it)"
        return f"kernel files {where}" + (", readable by the kernel user's group only" if self.gid is not None else "")

    def make_dir(self, path: Path, *, writable: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.share_dir(path, writable=writable)

    def share_dir(self, path: Path, *, writable: bool = False) -> None:
        if self.gid is not None:
            os.chown(path, -1, self.gid)
            os.chmod(path, 0o770 if writable else 0o750)

    def share_file(self, path: Path) -> None:
        if self.gid is not None:
            os.chown(path, -1, self.gid)
            os.chmod(path, 0o640)

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)


def _reachable(path: Path, uid: int, gid: int) -> bool:
    """Whether user `uid` (group `gid`, no other groups) may pass through each parent of
    `path` to it (by their mode bits)."""
    for directory in path.resolve().parents:
        st = directory.stat()
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True
