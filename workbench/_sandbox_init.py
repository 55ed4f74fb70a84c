"""Sandbox start-up, run by `unshare` as root of a fresh user, mount, network and PID namespace.

Standard library only (it runs with `python -I`, before any candidate code). It builds a new root
on a tmpfs holding only what the spec names (read-only system and Python directories, the model
files, the candidate's worktree read-only, an empty size-limited /tmp, a private /dev with five nodes
and a size-limited /dev/shm, a fresh /proc with /proc/sys read-only), pivots into
it, then enters one more user and mount namespace so those mounts are locked: the candidate,
although root inside, can neither unmount them nor see what lies under them. It then execs the
candidate with the spec's environment. There is no network device but loopback (down).

Usage: python -I _sandbox_init.py SPEC_JSON
"""

import ctypes
import json
import os
import platform
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_SET_NO_NEW_PRIVS = 38
DEV_NODES = ("null", "zero", "full", "random", "urandom")
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
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


def bind(root: str, path: str, writable: bool) -> None:
    if not os.path.exists(path):
        return
    dst = root + path
    if os.path.isdir(path):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(path, dst, None, MS_BIND | MS_REC)
    if not writable:
        mount("none", dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def main() -> None:
    spec = json.loads(sys.argv[1])
    root = "/tmp/.specpilot-sandbox-root"  # only a mount point; the host's /tmp is not touched beyond it
    os.makedirs(root, exist_ok=True)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    os.makedirs(root + "/tmp", exist_ok=True)  # first: a worktree may itself lie under /tmp
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec.get('tmp_size', '512m')}")
    for p in spec["read_only"]:
        bind(root, p, writable=False)
    for p in spec["read_write"]:
        bind(root, p, writable=True)
    # A private /dev: the few harmless nodes bound one by one, a size-limited /dev/shm that dies with
    # the sandbox (the host's /dev, its /dev/shm included, is never visible: no channel between runs).
    os.makedirs(root + "/dev", exist_ok=True)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for node in (*DEV_NODES, *spec.get("dev_extra", [])):
        open(root + "/dev/" + node, "a").close()
        mount("/dev/" + node, root + "/dev/" + node, None, MS_BIND)
    os.makedirs(root + "/dev/shm")
    mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={spec.get('shm_size', '64m')}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    mount("none", root + "/dev", None, MS_REMOUNT | MS_NOSUID | MS_NOEXEC | MS_RDONLY, "mode=755,size=64k")
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Kernel tunables and triggers read-only (a writable core_pattern is a path to host code execution).
    for p in ("/proc/sys", "/proc/sysrq-trigger"):
        if os.path.exists(root + p):
            mount(root + p, root + p, None, MS_BIND | MS_REC)
            mount("none", root + p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # pivot_root, not chroot: a chrooted process may not create the user namespace below.
    os.makedirs(root + "/.old", exist_ok=True)
    _check(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], root.encode(), (root + "/.old").encode()),
           "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount("none", "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the new / is read-only
    os.chdir(spec["cwd"])

    # Lock the mounts: a mount namespace owned by a less privileged user namespace cannot undo them.
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")

    if spec.get("rlimit_as"):
        resource.setrlimit(resource.RLIMIT_AS, (spec["rlimit_as"], spec["rlimit_as"]))
    # No file bigger than this anywhere (disk), a bounded number of open files, no core dumps.
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec.get("max_file_bytes", 256 << 20),) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec.get("max_open_files", 1024),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")  # no setuid gains
    argv = spec["argv"]
    os.execve(argv[0], argv, spec["env"])


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        print(f"sandbox: {e}", file=sys.stderr)
        sys.exit(70)
