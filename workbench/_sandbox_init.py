"""Sandbox start-up, run by `unshare` as root of a fresh user, mount, network and PID namespace.

Standard library only (it runs with `python -I`, before any candidate code). It builds a new root
on a tmpfs holding only what the spec names (read-only system and Python directories, the model
files, the candidate's worktree read-write, an empty /tmp, /dev and a fresh /proc), pivots into
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

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
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
    os.makedirs(root + "/dev", exist_ok=True)
    mount("/dev", root + "/dev", None, MS_BIND | MS_REC)
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
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
    argv = spec["argv"]
    os.execve(argv[0], argv, spec["env"])


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        print(f"sandbox: {e}", file=sys.stderr)
        sys.exit(70)
