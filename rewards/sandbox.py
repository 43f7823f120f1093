"""Run model-written Python programs in a sandbox: the security boundary of the project.

    result = run_python(code, stdin="3 4\\n", limits=Limits(timeout=5))
    report = run_tests(code, [{"input": "3 4\\n", "output": "7"}])    # passed fraction, any error
    reports = SandboxPool(workers=8).map_tests([(code, tests), ...])  # a batch, in parallel

Every run gets, in layers:

| layer | what | where |
|---|---|---|
| process | its own process and session; on timeout the whole process group is SIGKILLed | everywhere |
| limits | rlimits on CPU seconds, address space, processes, file size, open files; no core dumps | everywhere |
| files | a fresh working directory, deleted afterwards; stdin is the test input, then EOF; stdout and stderr go to files capped by the file-size limit | everywhere |
| environment | an empty environment (PATH, LANG, HOME only): no inherited secrets | everywhere |
| user | runs as an unprivileged uid of its own (one per parallel slot), so the process limit binds and the trainer's files are out of reach | as root |
| namespaces | new network (only a downed loopback: no network), mount (fresh tmpfs on /tmp, /var/tmp, /dev/shm; private /proc) and pid namespaces (cannot see or signal the trainer; everything dies with the run) | Linux as root, or with unprivileged user namespaces |

`python -m rewards.sandbox` prints which layers are active on this machine. Without root
or user namespaces (e.g. macOS, locked-down containers), programs run as the trainer's own
user: they can still be stopped by the limits, but network access and signals to the
trainer's processes are not blocked. Run untrusted code only where the table says "as root".

The child side is rewards/sandbox_launch.py: a few stdlib imports, so a run costs little more
than two interpreter starts.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
SANDBOX_UID_BASE = 61000  # uid of parallel slot k is SANDBOX_UID_BASE + k; no account is needed
NOGROUP = 65534


@dataclass
class Limits:
    timeout: float = 10.0            # wall-clock seconds for the whole run
    cpu_seconds: int = 10
    memory_mb: int = 1024            # address space
    max_processes: int = 16          # processes of the sandbox user (binds only for non-root uids)
    max_output_bytes: int = 1 << 20  # stdout, stderr and any file written
    max_open_files: int = 64


@dataclass
class RunResult:
    returncode: int                  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out


@dataclass
class TestReport:
    passed: int
    total: int
    error: bool                      # some run crashed, raised, was killed or timed out

    @property
    def pass_fraction(self):
        return self.passed / self.total if self.total else 0.0


# Parent side ------------------------------------------------------------------------------------

def _world_usable(path):
    """True when every directory on the way is world-searchable and the file world-executable."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o001)


def _unshare_works(flags):
    """Probe in a throwaway child whether these namespaces can be created here."""
    probe = "import ctypes,sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(%d) != 0)" % flags
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", probe], timeout=10, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_CAPS = None


def capabilities():
    """Which isolation layers this machine gives, probed once."""
    global _CAPS
    if _CAPS is None:
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        linux = sys.platform.startswith("linux")
        namespaces = linux and _unshare_works(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (0 if root else CLONE_NEWUSER))
        # The program runs `python -I -S`: no site, so a virtual environment's link adds nothing, and its real path
        # is taken, for a link under /tmp (CI's venv) lies where isolate() mounts a private /tmp. As root, the
        # sandbox user must be able to run the interpreter and read its standard library.
        real = [os.path.realpath(p) for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
                if os.path.exists(p)]
        python = next((p for p in real if (not root or _world_usable(p))
                       and not (namespaces and p.startswith(("/tmp/", "/var/tmp/", "/dev/shm/")))), sys.executable)
        _CAPS = {"platform": sys.platform, "root": root, "drop_privileges": root, "namespaces": namespaces,
                 "user_namespace": namespaces and not root, "python": python}
    return _CAPS


def _minimal_env(home):
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8"}


def _read_capped(path, cap):
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")


def run_python(code, stdin="", limits=None, slot=0):
    """Run `code` with `stdin` under every layer this machine offers; never raises for what the code does."""
    limits = limits or Limits()
    caps = capabilities()
    work = tempfile.mkdtemp(prefix="minigdpo-sandbox-")
    start = time.perf_counter()
    proc = None
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        with open(os.path.join(work, "stdin.txt"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(stdin)
        uid = SANDBOX_UID_BASE + slot if caps["drop_privileges"] else None
        if uid is not None:
            os.chmod(work, 0o700)
            for name in ("", "main.py", "stdin.txt"):
                os.chown(os.path.join(work, name), uid, NOGROUP)
        lim = limits
        config = [work, caps["python"], uid if uid is not None else -1, NOGROUP, int(caps["namespaces"]),
                  int(caps["user_namespace"]), os.getuid(), os.getgid(), lim.cpu_seconds, lim.memory_mb,
                  lim.max_processes, lim.max_output_bytes, lim.max_open_files]
        with open(os.path.join(work, "stdin.txt"), "rb") as fin, open(os.path.join(work, ".out"), "wb") as fout, \
                open(os.path.join(work, ".err"), "wb") as ferr:
            proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER, *map(str, config)],
                                    cwd=work, stdin=fin, stdout=fout, stderr=ferr, env=_minimal_env(work),
                                    start_new_session=True, close_fds=True)
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        cap = limits.max_output_bytes
        return RunResult(proc.returncode if proc.returncode is not None else -signal.SIGKILL,
                         _read_capped(os.path.join(work, ".out"), cap), _read_capped(os.path.join(work, ".err"), cap),
                         timed_out, time.perf_counter() - start)
    finally:  # also on an exception from outside (a reward timeout): nothing outlives the run
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _same_output(got, want):
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def run_tests(code, tests, limits=None, slot=0):
    """Run every test: {"input", "output"} compares stdout; {"assert": code} must exit cleanly."""
    passed, error = 0, False
    for test in tests:
        if "assert" in test:
            result = run_python(code + "\n\n" + test["assert"] + "\n", "", limits, slot)
            ok = result.ok
        else:
            result = run_python(code, test.get("input", ""), limits, slot)
            ok = result.ok and _same_output(result.stdout, test["output"])
        passed += ok
        error |= not result.ok
    return TestReport(passed, len(tests), error)


class SandboxPool:
    """Runs many programs at once on a bounded pool; each worker owns one sandbox uid (slot)."""

    def __init__(self, workers=None, limits=None):
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        self.limits = limits or Limits()
        self._slots = list(range(self.workers))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")

    def _run(self, code, tests):
        with self._lock:
            slot = self._slots.pop()
        try:
            return run_tests(code, tests, self.limits, slot)
        finally:
            with self._lock:
                self._slots.append(slot)

    def map_tests(self, jobs):
        """[(code, tests)] -> [TestReport], in order."""
        return list(self._pool.map(lambda job: self._run(*job), jobs))


def job_key(code, tests):
    return hashlib.sha256((code + "\0" + json.dumps(tests, sort_keys=True)).encode("utf-8", "surrogatepass")).hexdigest()


def _describe():
    caps = capabilities()
    rows = [("separate process, session, rlimits, fresh dir, empty env", True),
            (f"unprivileged uid per run (as root; interpreter {caps['python']})", caps["drop_privileges"]),
            ("no network, private /tmp and /proc, own pid namespace", caps["namespaces"])]
    return "\n".join(f"[{'x' if on else ' '}] {text}" for text, on in rows)


if __name__ == "__main__":
    print(_describe())
    r = run_python("import sys; print(sum(map(int, sys.stdin.read().split())))", "3 4\n")
    print(f"a test program ran in {r.seconds * 1000:.0f} ms and printed {r.stdout.strip()!r} (want '7')")
