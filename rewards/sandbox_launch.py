"""The child side of the sandbox: isolate, limit, drop privileges, then exec the program.

Run by rewards/sandbox.py as `python -I -S sandbox_launch.py WORK PYTHON UID GID NS USERNS
HOST_UID HOST_GID CPU MEM_MB NPROC FSIZE NOFILE`, with cwd WORK, stdin the test input and stdout
and stderr files. It imports only a few standard modules so that starting it stays cheap.
"""

import ctypes
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC = 0x20000, 0x10000000, 0x20000000, 0x40000000, 0x8000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV, MS_BIND = 0x4000, 0x40000, 0x2, 0x4, 0x1000


def _unshare(flags):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")
    return libc


def _mount(libc, source, target, fstype, flags, data):
    if os.path.isdir(target) and libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                                            flags, data.encode() if data else None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target} failed")


def isolate(user_namespace, host_uid, host_gid, tmp_bytes):
    """No network, private temp dirs and /proc, own pid space. Returns in the new namespace's pid 1."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if user_namespace else 0)
    libc = _unshare(flags)
    if user_namespace:  # map ourselves to root inside, so that mounts are allowed
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {host_uid} 1"), ("gid_map", f"0 {host_gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    pid = os.fork()  # the child is pid 1 of the new pid namespace: when it exits, every process in it dies
    if pid:
        _, status = os.waitpid(pid, 0)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    _mount(libc, "none", "/", None, MS_REC | MS_PRIVATE, None)
    for tmp in ("/tmp", "/var/tmp", "/dev/shm"):
        _mount(libc, "tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(1, tmp_bytes // 1024)}k,mode=1777")
    # The work dir may now lie under a covered /tmp; "." still reaches it through our cwd.
    os.mkdir("/tmp/work")
    _mount(libc, ".", "/tmp/work", None, MS_BIND, None)
    os.chdir("/tmp/work")
    os.environ["HOME"] = "/tmp/work"
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV, None)


def main(work, python, uid, gid, namespaces, user_namespace, host_uid, host_gid, cpu, mem_mb, nproc, fsize, nofile):
    os.chdir(work)
    if namespaces:
        isolate(user_namespace, host_uid, host_gid, fsize)
    for res, value in [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem_mb << 20,) * 2),
                       (resource.RLIMIT_FSIZE, (fsize,) * 2), (resource.RLIMIT_NOFILE, (nofile,) * 2),
                       (resource.RLIMIT_NPROC, (nproc,) * 2), (resource.RLIMIT_CORE, (0, 0))]:
        resource.setrlimit(res, value)
    if uid >= 0:  # as root: become an unprivileged user of our own, so RLIMIT_NPROC binds
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    os.execve(python, [python, "-I", "-S", "-B", "main.py"], os.environ)


if __name__ == "__main__":
    work, python, *numbers = sys.argv[1:]
    main(work, python, *map(int, numbers))
