"""The rights a child process gives up before it runs code that came over the network.

`tunefarm.isolation.IsolatedWorker(sandbox=Sandbox(...))` starts its child so (a device
agent's kernel runner); the child enters the sandbox (`enter_as_root` or
`enter_unprivileged`) and reports what it got (`SandboxStatus`):

- started by root: a network namespace of its own (`unshare(CLONE_NEWNET)`: no interface
  but a loopback that is down, so no connection to anything, the host's 127.0.0.1
  included) and a mount namespace of its own in which every unix socket the host listens
  on (the database's, Redis's, Docker's: reached through the file system, not the
  network) has /dev/null bound over it (`host_socket_paths`, `hide_paths`), then
  `Sandbox.user` (default `nobody`: setgroups([]), setgid, setuid), after
  its preload imports and before any call. What it reads must be readable by that user
  (and reachable: no parent directory closed to it), and every module it imports later
  too: preload what its calls import;
- started by another user: it stays that user, and takes a user, a network and a mount
  namespace of its own (the host's sockets hidden the same way) where unprivileged user
  namespaces are allowed (before any thread starts);
- either way `PR_SET_NO_NEW_PRIVS` (no setuid program gives it rights back), and an
  environment without the parent's secrets (`scrubbed_env`: no TUNEFARM_* variable, none
  whose name says token, secret, password or credential).

What the OS refuses is not an error: the status says which protection is missing.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import re
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000  # unshare(2): a network namespace of its own
CLONE_NEWUSER = 0x10000000  # unshare(2): a user namespace of its own
CLONE_NEWNS = 0x00020000  # unshare(2): a mount namespace of its own
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18  # mount(2) flags
SO_ACCEPTCON = 0x00010000  # /proc/net/unix: the socket listens
PR_SET_NO_NEW_PRIVS = 38  # prctl(2): execve never grants rights again

SECRET_ENV = re.compile(r"^TUNEFARM_|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
"""Environment variables a sandboxed child does not inherit (the agent's token among them)."""


@dataclass(frozen=True)
class Sandbox:
    """What a worker's child gives up before it runs any call (see the module docstring)."""

    user: str | None = "nobody"  # a child started by root runs as this user; None: it stays root
    no_network: bool = True  # a network namespace of its own: it reaches nothing


@dataclass(frozen=True)
class SandboxStatus:
    """What a sandboxed child got."""

    uid: int  # the child's user id, as the host sees it
    user: str  # its name
    own_network: bool  # in a network namespace of its own (no network)
    no_new_privs: bool  # PR_SET_NO_NEW_PRIVS is set
    problems: tuple[str, ...] = ()  # why a protection asked for is missing
    hidden_sockets: int = 0  # the host's listening unix sockets bound over with /dev/null

    def describe(self) -> str:
        """One line for a log: which protections are active."""
        parts = [
            f"runs as {self.user} (uid {self.uid})" + (" -- root!" if self.uid == 0 else ""),
            "no network (a network namespace of its own)" if self.own_network else "shares the host's network",
        ]
        if self.hidden_sockets:
            parts.append(f"the host's {self.hidden_sockets} unix socket(s) hidden")
        if self.no_new_privs:
            parts.append("no new privileges")
        text = ", ".join(parts)
        return f"{text}; {'; '.join(self.problems)}" if self.problems else text


def scrubbed_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the variables a sandboxed child must not see (`SECRET_ENV`)."""
    return {k: v for k, v in env.items() if not SECRET_ENV.search(k)}


def _libc_call(name: str, *args: int | bytes | None) -> str | None:
    """Call a libc function that returns -1 on failure; None, or why it failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        return f"{name}: {os.strerror(ctypes.get_errno())}"
    return None


def host_socket_paths(table: str | None = None) -> list[str]:
    """The file system paths of the unix sockets that listen on this host (`/proc/net/unix`
    of the current network namespace, or `table`'s text); abstract ones (`@...`) belong to
    the network namespace and need no hiding."""
    if table is None:
        try:
            with open("/proc/net/unix") as f:
                table = f.read()
        except OSError:
            return []
    paths = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[3], 16) & SO_ACCEPTCON and fields[7].startswith("/"):
            paths.append(fields[7])
    return sorted(set(paths))


def hide_paths(paths: list[str]) -> tuple[int, tuple[str, ...]]:
    """In this process's own mount namespace (already unshared): /dev/null bound over each
    path, the namespace's mounts made private first so that nothing reaches the host's.
    (How many were hidden, problems.)"""
    problem = _libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    if problem:
        return 0, (f"the host's sockets stay reachable ({problem})",)
    hidden, failed = 0, []
    for path in paths:
        if not os.path.exists(path):
            continue
        if _libc_call("mount", b"/dev/null", os.fsencode(path), None, MS_BIND, None) is None:
            hidden += 1
        else:
            failed.append(path)
    return hidden, ((f"unix sockets still reachable: {', '.join(failed)}",) if failed else ())


def enter_unprivileged(spec: Sandbox) -> tuple[bool, tuple[str, ...], int]:
    """Not root: a user namespace (mapping this user to itself) with a network and a mount
    namespace of its own, where the OS lets an unprivileged user make them. (Own network,
    problems, host sockets hidden.)"""
    if not spec.no_network:
        return False, (), 0
    uid, gid = os.getuid(), os.getgid()
    sockets = host_socket_paths()  # before the network namespace hides the host's table
    problem = _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS)
    if problem:
        return False, (f"the network is shared ({problem}: no unprivileged user namespaces here)",), 0
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as exc:
        return True, (f"its user is not mapped in its namespace ({exc.strerror})",), 0
    hidden, problems = hide_paths(sockets)
    return True, problems, hidden


def hide_host_sockets(spec: Sandbox) -> tuple[int, tuple[str, ...]]:
    """Root, before any thread starts (a mount namespace needs a process with one): a mount
    namespace of its own with the host's listening unix sockets hidden. (Hidden, problems.)"""
    if not spec.no_network:
        return 0, ()
    sockets = host_socket_paths()
    problem = _libc_call("unshare", CLONE_NEWNS)
    if problem:
        return 0, (f"the host's sockets stay reachable ({problem})",)
    return hide_paths(sockets)


def enter_as_root(spec: Sandbox) -> tuple[bool, tuple[str, ...], int]:
    """Root: a network namespace of its own, then `spec.user` (its mounts were made its own
    by `hide_host_sockets`). (Own network, problems, 0.)"""
    problems: list[str] = []
    own_network = False
    hidden = 0
    if spec.no_network:
        problem = _libc_call("unshare", CLONE_NEWNET)
        own_network = problem is None
        if problem:
            problems.append(f"the network is shared ({problem})")
    if spec.user:
        try:
            pw = pwd.getpwnam(spec.user)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
        except KeyError:
            problems.append(f"it stays root: there is no user {spec.user!r}")
        except OSError as exc:
            problems.append(f"it stays root: cannot become {spec.user} ({exc.strerror})")
    return own_network, tuple(problems), hidden


def seal(own_network: bool, problems: tuple[str, ...], hidden_sockets: int = 0) -> SandboxStatus:
    """Set no-new-privileges; what this process got, once it entered its sandbox."""
    no_new_privs = _libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) is None
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return SandboxStatus(uid, user, own_network, no_new_privs, problems, hidden_sockets)
