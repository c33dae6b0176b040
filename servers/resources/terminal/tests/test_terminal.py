"""The terminal environment: Harbor task folders in real bubblewrap sandboxes, scored by their own tests."""

import json
from pathlib import Path

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.terminal import harbor_task
from gym_grpc.bundled.servers.resources.terminal.server import TerminalEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.rpc.transport import open_channel
from gym_grpc.testing import static_registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import sandbox_service_pb2 as sb_pb
from gym_grpc.v1 import sandbox_service_pb2_grpc as sb_grpc

HERE = Path(__file__).resolve().parent.parent
TASKS = sorted(p.name for p in (HERE / "tasks").iterdir() if (p / "task.toml").is_file())
ROWS = {row["task"]: row for row in map(json.loads, (HERE / "data" / "example.jsonl").read_text().splitlines())}
DONE = r.Response(output=[assistant_message("done")])


@pytest.fixture
async def terminal(start):
    server = await start(TerminalEnv({"sandbox": {"max_alive": 8}}, name="terminal"))
    client = ResourcesClient(static_registry(terminal=server), "terminal")
    async with open_channel(server.address) as channel:
        yield client, sb_grpc.SandboxServiceStub(channel), server.app
    await client.registry.close()


async def _score(client, sandbox, task_name: str, solve: bool) -> dict:
    """Seed a session on the task, run its own solution/ in the sandbox when `solve`, verify, close."""
    session = f"{task_name}-{solve}"
    task = rows.task_from_row(ROWS[task_name])
    await client.seed_session(session, task)
    try:
        if solve:
            folder = HERE / "tasks" / task_name / "solution"
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                data = path.read_bytes()
                await sandbox.WriteFile(
                    sb_pb.WriteFileRequest(
                        session_id=session, path=f"/solution/{path.relative_to(folder)}", data=data, mode=0o755
                    )
                )
            ran = await sandbox.Exec(
                sb_pb.ExecRequest(
                    session_id=session, argv=["bash", "/solution/solve.sh"], cwd="/app", timeout_seconds=60
                )
            )
            assert ran.exit_code == 0, ran.stderr.decode()
        verdict = await client.verify(session, task, DONE)
    finally:
        await client.close_session(session)
    return {"reward": verdict.reward, **json.loads(verdict.fields_json or "{}")}


def test_every_bundled_task_has_a_row_and_reads_as_a_harbor_task():
    assert len(TASKS) >= 10
    assert sorted(ROWS) == TASKS
    for name in TASKS:
        task = harbor_task.load(HERE / "tasks" / name, TerminalEnv.sandbox_dirs)
        assert task.name == f"gym-grpc/{name}" and task.workdir == "/app" and "tests/test.sh" not in task.files
        assert "test.sh" in task.tests and "solve.sh" in task.solution


@pytest.mark.parametrize("task_name", TASKS)
async def test_a_tasks_own_solution_scores_1_and_doing_nothing_scores_0(terminal, task_name):
    client, sandbox, _ = terminal
    nothing = await _score(client, sandbox, task_name, solve=False)
    solved = await _score(client, sandbox, task_name, solve=True)
    assert (nothing["reward"], solved["reward"]) == (0.0, 1.0), (nothing, solved)
    assert solved["reward_file"] == "reward.txt" and not solved["tests_timed_out"]


async def test_the_hidden_tests_are_not_in_the_sandbox_until_verify(terminal):
    client, sandbox, _ = terminal
    task = rows.task_from_row(ROWS["python-fix-slugify"])
    await client.seed_session("s", task)
    listed = await sandbox.ListFiles(sb_pb.ListFilesRequest(session_id="s", path="/tests"))
    assert list(listed.entries) == []
    seen = await sandbox.Exec(
        sb_pb.ExecRequest(session_id="s", shell="ls -a /app; ls / ; cat /etc/passwd", timeout_seconds=30)
    )
    assert b"setup.sh" not in seen.stdout and b"home" not in seen.stdout.split() and seen.exit_code != 0
    await client.close_session("s")


@pytest.mark.parametrize(
    ("toml", "file", "named"),
    [
        ('[environment]\ndocker_image = "python:3.12"\n', None, "the container image 'python:3.12'"),
        ("", "environment/Dockerfile", "a container image built from environment/Dockerfile"),
        ("[environment]\ngpus = 1\n", None, "1 GPUs"),
        ('[environment]\nworkdir = "/srv"\n', None, "workdir '/srv' is not one of"),
    ],
)
def test_a_task_this_sandbox_cannot_run_is_refused_naming_what_it_needs(tmp_path, toml, file, named):
    folder = tmp_path / "needs-more"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text("do it")
    (folder / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt")
    if file:
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_text("FROM python:3.12\n")
    with pytest.raises(errors.ConfigError, match="needs-more") as caught:
        harbor_task.load(folder, TerminalEnv.sandbox_dirs)
    assert named in str(caught.value)
