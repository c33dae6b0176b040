"""Open files: every gym-grpc process raises its soft limit to the hard limit at start,
and `status` shows what each server got."""

import subprocess

import pytest

from tests.test_cli import MATH, _gym, _limit_open_files, _rows, _start_run, _status, _tool


def test_every_server_raises_its_open_file_limit_to_the_hard_limit_and_status_shows_it():
    run = _start_run(open_files=(256, 4096))
    try:
        code, rows = _status(run.registry)
        assert code == 0
        assert {name: row["open_files_limit"] for name, row in rows.items()} == {name: 4096 for name in rows}
        assert all(0 < row["open_files"] < 4096 for row in rows.values())
        table = _gym("status", "--registry", run.registry, "--interval", "0.2").stdout
        assert all(" of 4096" in line for line in table.splitlines()[1:])
    finally:
        run.stop()


@pytest.fixture(scope="module")
def many_channels():
    """The quickstart with math_agent on 4 processes: a collector opens 32 connections to it."""
    run = _start_run("servers.math_agent.num_workers=4")
    yield run
    run.stop()


def _collect_60(run, tmp_path, open_files: tuple[int, int]) -> subprocess.CompletedProcess:
    """`gym-grpc collect` of 60 math tasks at once (every connection used), with these open-file limits."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(MATH.read_text() * 10)
    args = ["--registry", run.registry, "--agent", "math_agent", "--input", str(tasks)]
    return subprocess.run(
        [_tool("gym-grpc"), "collect", *args, "--output", str(tmp_path / "out.jsonl"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_open_files(*open_files),
    )


def test_collect_raises_its_open_file_limit_so_a_low_soft_limit_costs_nothing(many_channels, tmp_path):
    done = _collect_60(many_channels, tmp_path, (32, 4096))  # 32 is fewer than it needs
    assert done.returncode == 0, done.stderr
    assert len(_rows(tmp_path / "out.jsonl")) == 60
