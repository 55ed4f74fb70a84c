"""Sandbox start-up, run by the harness with `python -I`, before any candidate code.

Standard library only. Started as the workbench's user, it
1. if that user is root: builds the new root (below) in a private mount namespace while every path
   can still be looked up, then drops to an unused host uid/gid (`SANDBOX_UID_BASE` + its pid: unique
   among running sandboxes, owning nothing on the host, so the process limit counts this sandbox alone);
2. enters fresh user, mount, network and PID namespaces (its uid is root of the new user namespace
   only) and forks the namespace's first process;
3. (or here, when not started as root) builds a new root on a tmpfs holding only what the spec names
   (read-only system and Python directories, the model files, the candidate's worktree read-only, the
   spec's held-out folders covered by empty ones, an empty size-limited /tmp, a private /dev with five
   nodes and a size-limited /dev/shm, a fresh /proc with /proc/sys read-only) and pivots into it;
4. enters one more user and mount namespace in which it is uid/gid `CANDIDATE_ID` (not root: the
   candidate execs with no capabilities at all) and whose mounts are locked;
5. sets the resource limits (address space, file size, open files, processes, no core dumps) and
   `PR_SET_NO_NEW_PRIVS`, then execs the candidate with the spec's environment.
There is no network device but loopback (down).

Usage: python -I _sandbox_init.py SPEC_JSON
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
MS_PRIVATE = 1 << 18
DEV_NODES = ("null", "zero", "full", "random", "urandom")
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
SANDBOX_UID_BASE = 1_610_000_000  # host uids [base, base + 2**22) are used for sandboxes, one per live sandbox
CANDIDATE_ID = 1000  # the candidate's uid and gid inside its namespace
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(src.encode(), dst.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None), f"mount {src} on {dst}")


def bind(root: str, path: str, writable: bool, at: str | None = None) -> None:
    """`path` mounted at the same place in the new root, or at `at` when given."""
    if not os.path.exists(path):
        return
    dst = root + (at or path)
    if os.path.isdir(path):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(path, dst, None, MS_BIND | MS_REC)
    if not writable:
        mount("none", dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def prctl(option: int, value: int, what: str) -> None:
    _check(libc.prctl(option, value, 0, 0, 0), what)


def build_root(spec: dict, root: str) -> None:
    """The candidate's file system on a tmpfs at `root`, then pivoted into (the old root detached)."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below reaches the host's namespace
    os.makedirs(root, mode=0o755, exist_ok=True)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    os.makedirs(root + "/tmp", exist_ok=True)  # first: a worktree may itself lie under /tmp
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec.get('tmp_size', '512m')}")
    for path in spec["read_only"]:
        bind(root, path, writable=False)
    for path in spec["read_write"]:
        bind(root, path, writable=True)
    for path, at, writable in spec.get("bind", []):  # a folder shown at another path (an engine build's source)
        bind(root, path, writable=bool(writable), at=at)
    for path in spec.get("hide", []):  # held-out data under a mounted folder: an empty read-only folder over it
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "mode=755,size=4k")
    # A private /dev: the few harmless nodes bound one by one, a size-limited /dev/shm that dies with
    # the sandbox (the host's /dev, its /dev/shm included, is never visible: no channel between runs).
    os.makedirs(root + "/dev", exist_ok=True)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for node in (*DEV_NODES, *spec.get("dev_extra", [])):
        open(root + "/dev/" + node, "a").close()
        mount("/dev/" + node, root + "/dev/" + node, None, MS_BIND)
    os.makedirs(root + "/dev/shm")
    mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"mode=1777,size={spec.get('shm_size', '64m')}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    mount("none", root + "/dev", None, MS_REMOUNT | MS_NOSUID | MS_NOEXEC | MS_RDONLY, "mode=755,size=64k")
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # pivot_root, not chroot: a chrooted process may not create the user namespaces below.
    os.makedirs(root + "/.old", exist_ok=True)
    _check(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], root.encode(), (root + "/.old").encode()),
           "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount("none", "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the new / is read-only


def sandbox_ident() -> int:
    """The unused host uid/gid this sandbox drops to (as root): unique among running sandboxes."""
    return SANDBOX_UID_BASE + os.getpid() % (1 << 22)


def own(paths: list, ident: int) -> None:
    """The spec's `own` folders (a build's own writable copy) handed to the uid the sandbox drops to, so its
    tools may change what they wrote before (permissions, times), as on the host."""
    for top in paths:
        for d, dirs, files in os.walk(top):
            for name in dirs + files:
                os.lchown(os.path.join(d, name), ident, ident)
        os.lchown(top, ident, ident)


def drop_privileges() -> None:
    """Root becomes an unused host uid/gid (a user namespace created by root would map the candidate
    onto the host's root): `SANDBOX_UID_BASE` + this pid, unique among running sandboxes, owning no
    file on the host, so the process limit counts this sandbox alone."""
    parent = os.getppid()
    ident = sandbox_ident()
    os.setgroups([])
    os.setresgid(ident, ident, ident)
    os.setresuid(ident, ident, ident)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")  # a uid change resets both
    prctl(PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")  # else /proc/self stays root's and maps cannot be written
    if os.getppid() != parent:
        raise OSError(0, "the harness died during start-up")


def enter_namespaces() -> None:
    """New user (this uid is its root), mount, network and PID namespaces; returns in the PID
    namespace's first process, while this process waits for it and passes its status on."""
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"0 {uid} 1")
    write("/proc/self/gid_map", f"0 {gid} 1")
    pid = os.fork()
    if pid:
        signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.umask(0o022)
    root = "/tmp/.specpilot-sandbox-root"  # only a mount point; the host's /tmp is not touched beyond it
    if os.geteuid() == 0:
        # As root: build the root in a private mount namespace while every path can still be looked up
        # (its /proc still shows the host's processes), then drop to the unused uid and enter the
        # namespaces, whose fresh /proc covers the first.
        _check(libc.unshare(CLONE_NEWNS), "unshare(mount)")
        build_root(spec, root)
        own(spec.get("own", []), sandbox_ident())
        drop_privileges()
        enter_namespaces()
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    else:
        enter_namespaces()
        build_root(spec, root)
    # One more user namespace below this one (the lock below) and no other: inside its own user
    # namespace the candidate could mount a tmpfs of any size, memory the harness does not see.
    write("/proc/sys/user/max_user_namespaces", "1")
    # Kernel tunables and triggers read-only (a writable core_pattern is a path to host code execution).
    for p in ("/proc/sys", "/proc/sysrq-trigger"):
        if os.path.exists(p):
            mount(p, p, None, MS_BIND | MS_REC)
            mount("none", p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(spec["cwd"])

    # Lock the mounts (a mount namespace owned by a less privileged user namespace cannot undo them)
    # and leave root: inside, the candidate is CANDIDATE_ID, which holds no capability after exec.
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{CANDIDATE_ID} 0 1")
    write("/proc/self/gid_map", f"{CANDIDATE_ID} 0 1")

    if spec.get("rlimit_as"):
        resource.setrlimit(resource.RLIMIT_AS, (spec["rlimit_as"], spec["rlimit_as"]))
    # No file bigger than this anywhere (disk), a bounded number of open files and processes (threads
    # count), no core dumps.
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec.get("max_file_bytes", 256 << 20),) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec.get("max_open_files", 1024),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec.get("max_processes", 512),) * 2)
    prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")  # no setuid gains
    argv = spec["argv"]
    os.execve(argv[0], argv, spec["env"])


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        print(f"sandbox: {e}", file=sys.stderr)
        sys.exit(70)
