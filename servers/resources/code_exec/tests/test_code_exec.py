"""The code execution environment: extraction, verdicts over gRPC, candidates that hang
or blow up, the event loop staying free, and the same verdicts on Ray."""

import _thread
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.code_exec import checker
from gym_grpc.bundled.servers.resources.code_exec.checker import run_tests
from gym_grpc.bundled.servers.resources.code_exec.server import CodeExecEnv, extract_code
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.rpc import transport
from gym_grpc.testing import ResourcesConformance, example_rows, static_registry
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "example.jsonl"

# Short limits keep the hanging candidates quick; the server's own verify limit is far above
# the candidate's deadline, so a verdict (rather than a failed Verify) proves the kill.
LIMITS = {"test_timeout_seconds": 0.5, "startup_seconds": 3.0, "memory_limit_mb": 256, "verify_timeout_seconds": 60}

ADD_TESTS = [{"args": [2, 3], "expected": 5}, {"args": [-1, 1], "expected": 0}, {"args": [10, 5], "expected": 15}]

ADD = "def add(a, b):\n    return a + b\n"


def _answer(code: str) -> r.Response:
    return r.Response(output=[assistant_message(f"Here is my solution.\n\n```python\n{code}```\n")])


def _task(tests=None, function_name="add"):
    return rows.task_from_row(
        {
            "responses_create_params": {"input": "Write add(a, b)."},
            "function_name": function_name,
            "tests": tests or ADD_TESTS,
        }
    )


async def _verdict(client, code, tests=None, function_name="add"):
    reply = await client.verify("s", _task(tests, function_name), _answer(code))
    return reply.reward, rows.json_field(reply, "fields"), dict(reply.reward_components)


async def _serve(start, **config):
    server = await start(CodeExecEnv({**LIMITS, **config}))
    return server, ResourcesClient(static_registry(code_exec=server), "code_exec")


@pytest.fixture
async def code_exec(start):
    _, client = await _serve(start, verify_workers=1)
    yield client
    await client.registry.close()


# --- extraction ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.", ADD),
        ("```py\ndef add(a, b):\n    return a + b\n```", ADD),
        ("```Python3\ndef add(a, b):\n    return a + b\n```", ADD),
        ("```\ndef add(a, b):\n    return a + b\n```", ADD),
        ("1. The code:\n   ```python\n   def add(a, b):\n       return a + b\n   ```\n", ADD),
        ("Cut off mid-answer:\n```python\ndef add(a, b):\n    return a + b\n", ADD),
        ("No code, only words: a + b.", None),
        ("```bash\npython add.py\n```", None),
    ],
)
def test_the_code_is_taken_from_a_fenced_block(text, expected):
    assert extract_code(text, "add") == expected


def test_python_blocks_win_over_unlabelled_ones_and_the_last_definition_wins():
    text = (
        "First try:\n```python\ndef add(a, b):\n    return a - b\n```\n"
        "Output:\n```\n-1\n```\n"
        "Fixed:\n```python\ndef add(a, b):\n    return a + b\n```\n"
        "Usage:\n```python\nprint(add(2, 3))\n```\n"
    )
    assert extract_code(text, "add") == ADD
    assert extract_code(text) == "print(add(2, 3))\n"


# --- verdicts over gRPC -----------------------------------------------------------


async def test_a_correct_function_earns_the_reward(code_exec):
    reward, fields, components = await _verdict(code_exec, ADD)
    assert reward == 1.0
    assert fields == {"tests_passed": 3, "tests_total": 3, "timeout": False, "error": ""}
    assert components == {"compiles": 1.0, "tests_passed_fraction": 1.0}


async def test_a_function_that_fails_one_test_earns_nothing_and_says_which(code_exec):
    code = "def add(a, b):\n    return a + b if a < 10 else 0\n"
    reward, fields, components = await _verdict(code_exec, code)
    assert reward == 0.0
    assert fields["tests_passed"] == 2 and fields["tests_total"] == 3
    assert fields["error"] == "test 3: expected 15, got 0"
    assert components == {"compiles": 1.0, "tests_passed_fraction": pytest.approx(2 / 3)}


async def test_a_syntax_error_does_not_compile(code_exec):
    reward, fields, components = await _verdict(code_exec, "def add(a, b)\n    return a + b\n")
    assert reward == 0.0 and components["compiles"] == 0.0
    assert fields["error"].startswith("SyntaxError") and "line 1" in fields["error"]


async def test_an_exception_fails_the_test_with_its_message(code_exec):
    reward, fields, components = await _verdict(code_exec, "def add(a, b):\n    return a / 0\n")
    assert reward == 0.0 and components["compiles"] == 1.0
    assert fields["error"] == "test 1: ZeroDivisionError: division by zero"


async def test_an_answer_without_a_code_block_earns_nothing(code_exec):
    reply = await code_exec.verify("s", _task(), r.Response(output=[assistant_message("a + b")]))
    assert reply.reward == 0.0 and "no ```python code block" in rows.json_field(reply, "fields")["error"]
    assert reply.reward_components["compiles"] == 0.0


async def test_a_missing_function_or_bad_module_code_fails_every_test(code_exec):
    _, fields, _ = await _verdict(code_exec, "def plus(a, b):\n    return a + b\n")
    assert fields["error"] == "the code defines no function 'add'" and fields["tests_passed"] == 0
    _, fields, _ = await _verdict(code_exec, "import no_such_module_here\n" + ADD)
    assert "ModuleNotFoundError" in fields["error"]


async def test_a_returned_object_that_claims_equality_does_not_pass(code_exec):
    code = (
        "class Anything:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Anything()\n"
    )
    reward, fields, _ = await _verdict(code_exec, code)
    assert reward == 0.0 and "not JSON data" in fields["error"]


async def test_tuples_and_close_floats_match_their_json(code_exec):
    tests = [{"args": [1, 2], "expected": [2, 1]}, {"args": [0.1, 0.2], "expected": [0.2, 0.1]}]
    reward, _, _ = await _verdict(code_exec, "def swap(a, b):\n    return (b, a)\n", tests, "swap")
    assert reward == 1.0
    reward, fields, _ = await _verdict(
        code_exec, "def total(a, b):\n    return a + b\n", [{"args": [0.1, 0.2], "expected": 0.3}], "total"
    )
    assert reward == 1.0, fields


async def test_an_infinite_loop_times_out_and_the_server_answers_the_next_verify(code_exec):
    reward, fields, components = await _verdict(code_exec, "def add(a, b):\n    while True:\n        pass\n")
    assert reward == 0.0 and fields["timeout"] is True
    assert fields["error"].startswith("test 1: timed out")
    assert components["tests_passed_fraction"] == 0.0
    assert (await _verdict(code_exec, ADD))[0] == 1.0


@pytest.mark.slow
async def test_a_candidate_that_ignores_its_alarm_is_killed_without_the_sandbox_too(start, tmp_path):
    """(test_sandbox.py has it in bubblewrap, where the candidate cannot write its pid here.)"""
    _, code_exec = await _serve(start, verify_workers=1, sandbox="none")
    pid_file = tmp_path / "pid"
    code = (
        "import os, signal, time\n"
        "def add(path):\n"
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "    open(path, 'w').write(str(os.getpid()))\n"
        "    time.sleep(3600)\n"
    )
    reward, fields, _ = await _verdict(code_exec, code, [{"args": [str(pid_file)], "expected": 1}])
    assert reward == 0.0 and fields["timeout"] is True
    assert fields["error"] == "test 1: killed after the time limit"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # gone, not left sleeping
    assert (await _verdict(code_exec, ADD))[0] == 1.0  # the (single) worker is free again
    await code_exec.registry.close()


async def test_a_memory_hog_fails_its_test_and_the_server_carries_on(code_exec):
    code = "def add(a, b):\n    hog = [0] * (10 ** 10)\n    return len(hog)\n"
    reward, fields, _ = await _verdict(code_exec, code)
    assert reward == 0.0 and fields["error"] == "test 1: MemoryError" and fields["timeout"] is False
    assert (await _verdict(code_exec, ADD))[0] == 1.0


async def test_a_candidate_that_exits_the_process_fails_the_rest(code_exec):
    code = "import os\ndef add(a, b):\n    if a == -1:\n        os._exit(3)\n    return a + b\n"
    _, fields, _ = await _verdict(code_exec, code)
    assert fields["tests_passed"] == 1 and fields["error"] == "test 2: the process exited with code 3"


async def test_a_candidate_that_writes_json_too_deep_to_parse_into_its_results_does_not_break_the_verifier(
    code_exec,
):
    code = (
        "import sys\n"
        "def add(a, b):\n"
        "    with open(sys.argv[2], 'a') as f:\n"
        "        f.write('[' * 100_000 + ']' * 100_000 + '\\n')\n"
        "    return a + b\n"
    )
    reward, fields, _ = await _verdict(code_exec, code)
    assert reward == 1.0 and fields["tests_passed"] == fields["tests_total"]  # its junk is passed over like any other


@pytest.mark.parametrize(
    "data, field",
    [
        ({"tests": ADD_TESTS}, "task.data.function_name"),
        ({"function_name": "add; import os", "tests": ADD_TESTS}, "task.data.function_name"),
        ({"function_name": "add", "tests": []}, "task.data.tests"),
        ({"function_name": "add", "tests": [{"args": 1, "expected": 2}]}, "task.data.tests[0]"),
        ({"function_name": "add", "tests": [{"args": [1]}]}, "task.data.tests[0]"),
    ],
)
async def test_a_malformed_task_is_an_invalid_argument_naming_the_field(start, data, field):
    server, client = await _serve(start, verify_workers=1)
    task = rows.task_from_row({"responses_create_params": {"input": "?"}, **data})
    channel = transport.open_channel(server.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            request = res_pb.VerifyRequest(session_id="s", task=task, response=_answer(ADD))
            await res_grpc.ResourcesServiceStub(channel).Verify(request, timeout=10)
    finally:
        await channel.close()
        await client.registry.close()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors.field_of(error.value) == field


# --- the event loop stays free ------------------------------------------------------


async def test_a_slow_verify_does_not_hold_up_other_calls(start, tmp_path):
    # Without the sandbox, so that the candidate can reach the files that pace it.
    server, client = await _serve(start, verify_workers=2, test_timeout_seconds=30, sandbox="none")
    started, release = tmp_path / "started", tmp_path / "release"
    waiter = (
        "import os, time\n"
        "def wait(started, release):\n"
        "    open(started, 'w').close()\n"
        "    while not os.path.exists(release):\n"
        "        time.sleep(0.01)\n"
        "    return True\n"
    )
    slow = asyncio.create_task(
        _verdict(client, waiter, [{"args": [str(started), str(release)], "expected": True}], "wait")
    )
    try:
        while not started.exists():  # the candidate is running in its child
            assert not slow.done(), slow.result()
            await asyncio.sleep(0.02)
        channel = transport.open_channel(server.address)
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        finally:
            await channel.close()
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert not (await client.describe_tools()).tools
        assert (await _verdict(client, ADD))[0] == 1.0  # a second verify, on the second worker
        assert not slow.done()
    finally:
        release.touch()
    assert (await slow)[0] == 1.0
    await client.registry.close()


async def test_concurrent_verifies_all_get_their_own_verdict(start):
    _, client = await _serve(start, verify_workers=2)
    codes = [
        ADD,
        "def add(a, b):\n    return a * b\n",
        "def add(a, b)\n",
        ADD,
        "def add(a, b):\n    raise KeyError(a)\n",
    ]
    verdicts = await asyncio.gather(*(_verdict(client, code) for code in codes))
    assert [reward for reward, _, _ in verdicts] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert [components["compiles"] for _, _, components in verdicts] == [1.0, 1.0, 0.0, 1.0, 1.0]
    await client.registry.close()


# --- the example rows ---------------------------------------------------------------

REFERENCE = {
    "is_palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
    "two_sum": (
        "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n"
        "        if target - x in seen:\n            return [seen[target - x], j]\n        seen[x] = j\n"
    ),
    "merge_intervals": (
        "def merge_intervals(intervals):\n    out = []\n    for s, e in sorted(intervals):\n"
        "        if out and s <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], e)\n"
        "        else:\n            out.append([s, e])\n    return out\n"
    ),
    "roman_to_int": (
        "def roman_to_int(s):\n    v = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)\n    total = 0\n"
        "    for a, b in zip(s, s[1:] + ' '):\n        total += -v[a] if b != ' ' and v[a] < v[b] else v[a]\n"
        "    return total\n"
    ),
    "count_primes": (
        "def count_primes(n):\n    if n < 3:\n        return 0\n"
        "    sieve = bytearray([1]) * n\n    sieve[0] = sieve[1] = 0\n"
        "    for i in range(2, int(n ** 0.5) + 1):\n        if sieve[i]:\n"
        "            sieve[i * i :: i] = bytes(len(range(i * i, n, i)))\n    return sum(sieve)\n"
    ),
}


def test_every_example_row_loads_as_a_task():
    examples = example_rows(EXAMPLES, CodeExecEnv)
    assert len(examples) == 5
    for row in examples:
        task = rows.task_from_row(row)
        data = rows.task_data(task)
        assert data["function_name"] in REFERENCE and data["tests"] == row["tests"]


def test_a_reference_solution_passes_every_example_row():
    for row in example_rows(EXAMPLES, CodeExecEnv):
        data = rows.task_data(rows.task_from_row(row))  # the tests as verify sees them
        verdict = run_tests(
            REFERENCE[data["function_name"]],
            data["function_name"],
            data["tests"],
            test_timeout=5.0,
            memory_mb=512,
            startup_seconds=5.0,
        )
        assert verdict["passed"] == verdict["total"], (data["function_name"], verdict)


@pytest.fixture
def interruptible():
    """SIGINT raises KeyboardInterrupt, as in a Ray worker: a test run as a shell's background job
    (a soak) inherits it ignored, and `interrupt_main` then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class InterruptedPopen(subprocess.Popen):
    """A child started, then interrupted as Ray's task cancellation does (`_thread.interrupt_main`)
    before `Popen` returns; `started` holds the pids."""

    started: list[int] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started.append(self.pid)
        _thread.interrupt_main()
        for _ in range(1000):  # bytecode, where a pending interrupt is raised
            pass


def test_an_interrupt_that_lands_while_the_child_starts_still_kills_it(monkeypatch, interruptible):
    """Ray cancels a running task with a KeyboardInterrupt, which can land inside `Popen`, at the
    last moment: the child has started and `Popen` has not returned. Before the fix the child was
    left running."""
    monkeypatch.setattr(InterruptedPopen, "started", [])
    monkeypatch.setattr(checker.subprocess, "Popen", InterruptedPopen)
    with pytest.raises(KeyboardInterrupt):
        run_tests(ADD, "add", ADD_TESTS, test_timeout=60, memory_mb=512, startup_seconds=5)
    _assert_gone(InterruptedPopen.started)


def test_a_process_that_ignores_sigint_checks_on_when_interrupted(monkeypatch):
    """Where SIGINT is ignored (a server started as a shell's background job), an interrupt does
    nothing, as Python's own `interrupt_main` says: the check is not cut short by one either."""
    monkeypatch.setattr(InterruptedPopen, "started", [])
    monkeypatch.setattr(checker.subprocess, "Popen", InterruptedPopen)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        verdict = run_tests(ADD, "add", ADD_TESTS, test_timeout=60, memory_mb=512, startup_seconds=5)
    except KeyboardInterrupt:
        pytest.fail("the check was interrupted although SIGINT is ignored")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert verdict["passed"] == verdict["total"] == len(ADD_TESTS), verdict


def test_an_interrupt_at_any_line_of_a_check_and_another_right_after_leave_no_child_and_no_scratch(
    monkeypatch, tmp_path, interruptible
):
    """Ray cancels a running task with `_thread.interrupt_main` and may repeat the cancel while the
    first is handled. Here the first lands at each line `run_program` runs in turn (a line tracer
    fires it) and the second at the next call or return anywhere after it (a profiler fires it), so
    every place a cancel can land is tried, the clean-up's among them. Before the fix a second one
    landing as the clean-up began skipped the kill, and the candidate ran on to its own deadline (a
    CI run saw it). An interrupt raised in the tracer or the profiler unsets it and goes on from the
    line or call where it fired, as a cancel landing there would."""
    started: list[int] = []

    class RecordedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)

    monkeypatch.setattr(checker.subprocess, "Popen", RecordedPopen)
    monkeypatch.setattr(checker.tempfile, "tempdir", str(tmp_path))  # where the scratch directories go
    code = checker.run_program.__code__

    def again(frame, event, arg):
        sys.setprofile(None)
        _thread.interrupt_main()

    fired: list[int] = []

    def check(first: int | None) -> int:
        """One check with a cancel at line event `first` of run_program, repeated right after; how
        many line events it ran."""
        lines = 0

        def line(frame, event, arg):
            nonlocal lines
            if event == "line":
                lines += 1
                if lines - 1 == first:
                    fired.append(first)
                    sys.setprofile(again)
                    _thread.interrupt_main()
            return line

        sys.settrace(lambda frame, event, arg: line if frame.f_code is code else None)
        try:
            run_tests(ADD, "add", ADD_TESTS, test_timeout=60, memory_mb=512, startup_seconds=5)
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        return lines

    total = check(None)
    assert total > 20
    for first in range(total):
        started.clear()
        fired.clear()
        try:
            check(first)
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail(f"line event {first}: {'interrupted' if fired else 'nothing fired'}, and the check returned")
        try:
            for _ in range(1000):  # bytecode, where an interrupt still pending would be raised
                pass
        except KeyboardInterrupt:
            pytest.fail(f"interrupted at line event {first}: an interrupt outlived the check")
        for pid in started:
            _assert_gone([pid])
        assert not list(tmp_path.iterdir()), f"interrupted at line event {first}: scratch left"


def _assert_gone(started: list[int]) -> None:
    """The one child started is killed and reaped: its pid disappears (a zombie's never does)."""
    [pid] = started
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    if state != "Z":
        os.killpg(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the child {pid} was left {'unreaped' if state == 'Z' else 'running'}")


class TestCodeExecConformance(ResourcesConformance):
    task_row = {"responses_create_params": {"input": "Write add(a, b)."}, "function_name": "add", "tests": ADD_TESTS}
    answer = f"```python\n{ADD}```"

    def server(self) -> CodeExecEnv:
        return CodeExecEnv({"verify_workers": 1})


# --- Ray ----------------------------------------------------------------------------


SAME_ON_BOTH = [
    ADD,
    "def add(a, b):\n    return a - b\n",
    "def add(a, b)\n    return a + b\n",
    "def add(a, b):\n    return {}[a]\n",
    "def add(a, b):\n    while True:\n        pass\n",
]


@pytest.mark.slow
async def test_a_check_on_ray_gives_the_same_verdict_as_the_process_pool(start, local_ray):
    on_ray, ray_client = await _serve(start, ray_address="local", verify_workers=1)
    assert on_ray.app.pool.on_ray
    _, pool_client = await _serve(start, verify_workers=1)
    for code in SAME_ON_BOTH:
        assert await _verdict(ray_client, code) == await _verdict(pool_client, code), code
    await ray_client.registry.close()
    await pool_client.registry.close()


@pytest.mark.parametrize("sandbox", ["bwrap", "none"])
async def test_a_verify_that_runs_out_of_time_on_ray_kills_its_candidate(start, local_ray, tmp_path, sandbox):
    await _a_verify_out_of_time_kills_its_candidate(start, tmp_path, sandbox, ray_address="local")


@pytest.mark.parametrize("sandbox", ["bwrap", "none"])
async def test_a_verify_that_runs_out_of_time_in_the_process_pool_kills_its_candidate(start, tmp_path, sandbox):
    """The pool cannot cancel a running call: the check ends itself at the verify's deadline."""
    await _a_verify_out_of_time_kills_its_candidate(start, tmp_path, sandbox)


async def _a_verify_out_of_time_kills_its_candidate(start, tmp_path, sandbox, **config):
    _, client = await _serve(
        start, verify_workers=1, verify_timeout_seconds=2, test_timeout_seconds=60, sandbox=sandbox, **config
    )
    pid_file = tmp_path / "pid"
    sleeper = "import os, time\ndef add(path):\n    open(path, 'w').write(str(os.getpid()))\n    time.sleep(3600)\n"
    if sandbox == "bwrap":  # the candidate cannot write here: it is seen in /proc, and sleeps at once
        sleeper = "import time\ndef add(path):\n    time.sleep(3600)\n"
    verify = asyncio.create_task(_verdict(client, sleeper, [{"args": [str(pid_file)], "expected": 1}]))
    seen: list[int] = []
    while not verify.done() and not seen:
        seen = sandboxed()
        await asyncio.sleep(0.05)
    with pytest.raises(errors.GymError, match="did not finish within 2 s"):
        await verify
    if sandbox == "bwrap":
        assert seen, "the sandboxed check was never seen running"
        await assert_nothing_left_running()
    else:
        await _assert_killed(int(pid_file.read_text()))
    assert (await _verdict(client, ADD))[0] == 1.0
    await client.registry.close()


async def _assert_killed(pid: int) -> None:
    for _ in range(100):  # the cancel or the check's own deadline kills the candidate's group
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.1)
    state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]  # Z: killed but not reaped
    pytest.fail(f"the candidate {pid} outlived its verify's deadline (state {state})")


def sandboxed() -> list[int]:
    """Processes of a code_exec check in bubblewrap now running on this machine: bwrap itself and
    what runs inside it (their command lines name the results file's path in the sandbox)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"/sandbox/results.jsonl" in cmdline:
            found.append(int(entry.name))
    return found


async def assert_nothing_left_running() -> None:
    for _ in range(100):  # the kill reaches the namespace's processes through bwrap's death
        left = sandboxed()
        if not left:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"processes of the check outlived it: {left}")
