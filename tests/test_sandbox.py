"""The code sandbox: hostile programs end within their limits, score 0, and leave the trainer
(this test process) unharmed; correct programs score 1.

Run: pytest tests/test_sandbox.py   (about 30 s; the fork bomb runs only where the process
limit binds, i.e. when the sandbox drops root or runs as a normal user)
"""

import glob
import os
import signal
import socket
import tempfile
import time

import pytest

from rewards.code import problems
from rewards.sandbox import Limits, SandboxPool, capabilities, run_python, run_tests

PROBLEMS = problems()
from rewards.code import extract_program, no_bug_reward, pass_reward

LIMITS = Limits(timeout=6.0, cpu_seconds=3, memory_mb=512, max_output_bytes=1 << 20)


def score(code, expected="ok\n"):
    """pass and no_bug of a program whose one test expects `expected` on stdout."""
    example = {"tests": [{"input": "", "output": expected}]}
    completion = f"```python\n{code}\n```"
    return pass_reward(completion, example), no_bug_reward(completion, example)


@pytest.fixture(autouse=True)
def short_limits(monkeypatch):
    monkeypatch.setattr("rewards.code.LIMITS", LIMITS)


def test_reference_solutions_score_one():
    for p in PROBLEMS[:6]:
        example = {"tests": p["tests"]}
        assert pass_reward(f"Here you go:\n```python\n{p['solution']}\n```\n", example) == 1.0, p["name"]
        assert no_bug_reward(f"```python\n{p['solution']}\n```", example) == 1.0


def test_wrong_and_broken_programs():
    assert score("print('no')") == (0.0, 1.0)          # ran fine, wrong answer
    assert score("def f(:") == (0.0, 0.0)              # compile error
    assert score("raise ValueError('x')") == (0.0, 0.0)
    assert score("print('ok')") == (1.0, 1.0)


def assert_bounded(code, expected="ok\n", seconds=LIMITS.timeout + 3):
    t = time.perf_counter()
    assert score(code, expected) == (0.0, 0.0)
    assert time.perf_counter() - t < seconds


def test_infinite_loop():
    assert_bounded("while True:\n    pass")


def test_sleeping_forever():
    assert_bounded("import time\ntime.sleep(1000)")


def test_fork_bomb():
    caps = capabilities()
    if caps["root"] and not caps["drop_privileges"]:
        pytest.skip("as root without a privilege drop, RLIMIT_NPROC would not bind")
    assert_bounded("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    time.sleep(0.5)
    survivors = [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox_process(p)]
    assert survivors == []


def _is_sandbox_process(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"main.py" in f.read()
    except OSError:
        return False


def test_allocating_50_gb():
    assert_bounded("x = bytearray(50 * 2**30)\nprint('ok')")


def test_writing_outside_the_working_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory of the trainer's is out of reach
    shared_tmp = os.path.join(tempfile.gettempdir(), "minigdpo-escaped.txt")
    assert_bounded(f"open({str(target)!r}, 'w').write('x')\nopen({shared_tmp!r}, 'w').write('x')\nprint('ok')")
    assert not target.exists()
    if capabilities()["namespaces"]:
        assert not os.path.exists(shared_tmp)  # /tmp is a private tmpfs inside the sandbox


def test_reading_environment_variables(monkeypatch):
    monkeypatch.setenv("MINIGDPO_TEST_SECRET", "hunter2")
    # The program runs cleanly but cannot see the secret, so it cannot print the expected output.
    assert score("import os\nprint(os.environ.get('MINIGDPO_TEST_SECRET', 'none'))", expected="hunter2\n") == (0.0, 1.0)
    result = run_python("import os\nprint(sorted(os.environ))", limits=LIMITS)
    assert "MINIGDPO_TEST_SECRET" not in result.stdout


def test_printing_1_gb():
    t = time.perf_counter()
    result = run_python("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)", limits=LIMITS)
    assert not result.ok and len(result.stdout) <= LIMITS.max_output_bytes
    assert time.perf_counter() - t < LIMITS.timeout + 3
    assert_bounded("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)")


def test_killing_the_parent():
    caps = capabilities()
    if not (caps["namespaces"] or caps["drop_privileges"]):
        pytest.skip("without a pid namespace or another uid, a program can signal its own user's processes")
    me = os.getpid()
    assert_bounded(f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({me}, signal.SIGKILL)\n"
                   f"os.killpg(0, signal.SIGKILL)\nprint('ok')")
    assert os.getpid() == me  # still here


def test_opening_a_socket():
    if not capabilities()["namespaces"]:
        pytest.skip("no network namespace on this machine")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    assert_bounded(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.send(b'hi')\nprint('ok')")
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_nothing_is_left_behind():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "minigdpo-sandbox-*")))
    run_python("open('junk', 'w').write('x' * 1000)\nprint('ok')", limits=LIMITS)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "minigdpo-sandbox-*"))) == before


def test_reward_timeout_mid_run_cleans_up():
    """A SIGALRM from the reward scorer interrupts a run; the program must still be killed."""
    from minigdpo.scoring import TimeUp as RewardTimeout

    def alarm(signum, frame):
        raise RewardTimeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(RewardTimeout):
            run_python("import time\ntime.sleep(100)", limits=LIMITS)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    time.sleep(0.3)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox_process(p)]


def test_pool_runs_a_batch_in_parallel_and_in_order():
    pool = SandboxPool(workers=2, limits=LIMITS)
    jobs = [(p["solution"], p["tests"]) for p in PROBLEMS[:8]] + [("print(0)", PROBLEMS[0]["tests"])]
    reports = pool.map_tests(jobs)
    assert [r.passed for r in reports] == [3] * 8 + [0]


def test_assert_style_tests_and_program_extraction():
    assert run_tests("def f(x):\n    return 2 * x", [{"assert": "assert f(2) == 4"}, {"assert": "assert f(1) == 3"}],
                     LIMITS).passed == 1
    assert extract_program("a\n```python\nprint(1)\n```\nb\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


def test_an_interpreter_in_a_virtual_environment_under_tmp_still_runs_the_program(monkeypatch):
    """A virtual environment under /tmp (CI's is /tmp/minigdpo-ci) gives a python that the sandbox's own private /tmp
    hides from the program: every program failed and every code reward read 0, silently. It runs now."""
    import shutil

    from rewards import sandbox

    if not capabilities()["namespaces"]:
        pytest.skip("the private /tmp comes with the mount namespace, which this machine does not give")
    base = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)
                 and sandbox._world_usable(p)), None)  # what `python3 -m venv` links to, runnable by every user
    if base is None:
        pytest.skip("no python3 here that every user can run")
    venv = tempfile.mkdtemp(dir="/tmp")  # as `python -m venv /tmp/...` makes it: searchable by every user
    try:
        os.chmod(venv, 0o755)
        os.symlink(base, os.path.join(venv, "python"))
        monkeypatch.setattr(sandbox, "_CAPS", None)
        monkeypatch.setattr(sandbox.sys, "executable", os.path.join(venv, "python"))
        result = run_python("print(6 * 7)", limits=LIMITS)
        assert (result.returncode, result.stdout) == (0, "42\n"), result.stderr
    finally:
        shutil.rmtree(venv)
