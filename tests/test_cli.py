"""The `gym-grpc` command as a user runs it: real processes, real ports, grpcurl."""

import functools
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gym_grpc.testing.processes import descendants
from tests.support import (
    MATH,
    REPO,
    WEATHER,
    alive,
    collect_args,
    cpu_ticks,
    grpcurl,
    gym,
    listening_pids,
    one_server_config,
    read_rows,
    run_status,
    start_run,
    tool,
)


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    done = gym("quickstart", "--output-dir", str(tmp_path), "--num-repeats", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)
    assert set(metrics) == {"weather_agent", "math_agent"}
    assert metrics["weather_agent"]["rollouts"] == 5 * 2 and metrics["math_agent"]["rollouts"] == 6 * 2
    for agent, data in (("weather_agent", WEATHER), ("math_agent", MATH)):
        assert 0.0 <= metrics[agent]["reward"] <= 1.0
        written = read_rows(tmp_path / f"{agent}_rollouts.jsonl")
        tasks = read_rows(data)
        assert sorted((row["task_index"], row["repeat_index"]) for row in written) == [
            (t, k) for t in range(len(tasks)) for k in range(2)
        ]
        for row in written:
            task = tasks[row["task_index"]]
            assert {k: row[k] for k in task} == task  # the input row is carried unchanged
            assert row["response"]["output"] and row["reward"] in (0.0, 1.0)
    assert "servers healthy" in done.stderr


@pytest.fixture(scope="module")
def live():
    """`gym-grpc run configs/quickstart.yaml` in the background, with its addresses."""
    with start_run() as run:
        yield {"process": run.process, "registry": run.registry, "servers": run.servers}


def test_run_serves_every_server_and_grpcurl_lists_them(live):
    assert set(live["servers"]) == {"policy_model", "weather", "weather_agent", "math", "math_agent"}
    assert "gym.v1.RegistryService" in grpcurl(live["registry"], "list")
    expected = {
        "policy_model": "gym.v1.ModelService",
        "weather": "gym.v1.ResourcesService",
        "weather_agent": "gym.v1.AgentService",
    }
    for name, service in expected.items():
        listed = grpcurl(live["servers"][name], "list").split()
        assert service in listed and "grpc.health.v1.Health" in listed
    described = grpcurl(live["servers"]["weather"], "describe", "gym.v1.ResourcesService")
    assert "rpc CallTool ( .gym.v1.CallToolRequest ) returns ( .gym.v1.CallToolResponse )" in described
    listing = json.loads(grpcurl(live["registry"], "gym.v1.RegistryService/ListServers"))
    agent = next(s for s in listing["servers"] if s["name"] == "weather_agent")
    assert agent["references"] == {"model": "policy_model", "resources": "weather"}


def test_grpcurl_runs_a_rollout_and_calls_a_tool(live):
    request = {
        "task": {
            "responses_create_params": {"input_text": "What is 6 times 7?", "temperature": 0},
            "data": {"expected_answer": "42"},
        }
    }
    rollout = json.loads(grpcurl("-d", json.dumps(request), live["servers"]["math_agent"], "gym.v1.AgentService/Run"))
    assert rollout["rollout"]["reward"] == 1
    assert rollout["rollout"]["stop_reason"] == "STOP_REASON_FINAL_MESSAGE"
    seed = {"session_id": "grpcurl-1", "task": {"responses_create_params": {"input_text": "hi"}}}
    weather = live["servers"]["weather"]
    grpcurl("-d", json.dumps(seed), weather, "gym.v1.ResourcesService/SeedSession")
    call = {"session_id": "grpcurl-1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    output = json.loads(grpcurl("-d", json.dumps(call), weather, "gym.v1.ResourcesService/CallTool"))
    assert json.loads(output["output"])["city"] == "Oslo"


def test_collect_writes_rollouts_and_a_second_run_resumes(live, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    args = [
        *collect_args(live["registry"], "math_agent", str(MATH), str(out)),
        "--num-repeats",
        "3",
        "--limit",
        "4",
        "--no-progress",
    ]
    first = gym(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["math_agent"]["rollouts"] == 12
    assert len(read_rows(out)) == 12
    second = gym(*args)
    assert second.returncode == 0, second.stderr
    assert "12 already done" in second.stderr
    assert len(read_rows(out)) == 12


def _wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (`run-<id>.wandb`), as wandb's own protobuf `Record`s. The file is
    LevelDB's log format: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type, data) that
    make up records (type 1 whole, 2 first, 3 middle, 4 last). wandb 0.31 reads it in Go only."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # a block's tail too short for a chunk header is padding
            at += 32768 - at % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _report_metrics(output: Path) -> dict[str, float]:
    """`gym-grpc report --json`'s metrics of the file's one agent, named as the exporters name them."""
    done = gym("report", str(output), "--json")
    assert done.returncode == 0, done.stderr
    [(agent, data)] = json.loads(done.stdout)["files"][0]["agents"].items()
    return {f"{agent}/{k.replace('@', '_at_')}": v for k, v in data["metrics"].items() if v is not None}


def test_collect_logs_its_report_to_wandb_offline(live, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    args = [*collect_args(live["registry"], "math_agent", str(MATH), str(out)), "--num-repeats", "2", "--no-progress"]
    done = gym(*args, "--wandb", "gym-grpc-tests", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"W&B: {out} -> " in done.stderr
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    [run_file] = run_dir.glob("run-*.wandb")
    records = _wandb_records(run_file)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("gym-grpc-tests", "rollouts")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["num_repeats"] == 2 and config["agent"] == "math_agent"
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.summary.update}
            )
    expected = _report_metrics(out)
    assert {k: summary[k] for k in expected} == pytest.approx(expected)
    assert "math_agent/pass_at_2" in expected
    [table] = (run_dir / "files" / "media" / "table").glob("rollouts_*.table.json")
    rollouts = json.loads(table.read_text())
    assert rollouts["columns"][:4] == ["agent", "task_index", "repeat_index", "reward"] and len(rollouts["data"]) == 12
    assert sorted(line[1:3] for line in rollouts["data"]) == [[t, k] for t in range(6) for k in range(2)]


def test_report_logs_to_mlflow_a_run_per_file_with_metrics_parameters_and_tables(live, tmp_path):
    import mlflow

    out = tmp_path / "rollouts.jsonl"
    args = [*collect_args(live["registry"], "math_agent", str(MATH), str(out)), "--num-repeats", "2", "--no-progress"]
    assert gym(*args).returncode == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = gym(
        "report", str(out), "--mlflow", "gym-grpc-tests", env={**os.environ, "MLFLOW_TRACKING_URI": uri}, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("gym-grpc-tests")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "rollouts" and f"run {run.info.run_id}" in done.stderr
    expected = _report_metrics(out)
    assert {k: run.data.metrics[k] for k in expected} == pytest.approx(expected)
    assert run.data.params["num_repeats"] == "2" and run.data.params["agent"] == "math_agent"
    curve = client.get_metric_history(run.info.run_id, "math_agent/pass_at_k")
    assert [m.step for m in curve] == [1, 2]
    assert [m.value for m in curve] == pytest.approx(
        [expected["math_agent/pass_at_1"], expected["math_agent/pass_at_2"]]
    )
    tables = {}
    for name in ("rollouts.json", "tasks.json"):
        table = json.loads(Path(client.download_artifacts(run.info.run_id, name, str(tmp_path))).read_text())
        tables[name] = [dict(zip(table["columns"], line, strict=True)) for line in table["data"]]
    assert sorted((line["task_index"], line["repeat_index"]) for line in tables["rollouts.json"]) == [
        (t, k) for t in range(6) for k in range(2)
    ]
    assert sorted(line["task_index"] for line in tables["tasks.json"]) == list(range(6))


def test_an_exporter_that_cannot_log_says_why_and_leaves_the_rollouts(live, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    args = [*collect_args(live["registry"], "math_agent", str(MATH), str(out)), "--limit", "2", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    done = gym(*args, "--wandb", "p", env={**env, "HOME": str(tmp_path)}, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "W&B: " in done.stderr and "WANDB_API_KEY" in done.stderr and "gym-grpc report" in done.stderr
    assert len(read_rows(out)) == 2


def test_collect_into_the_output_of_another_run_is_refused_and_says_what_differs(live, tmp_path):
    out = tmp_path / "rollouts.jsonl"

    def weather(*extra: str) -> subprocess.CompletedProcess:
        args = collect_args(live["registry"], "weather_agent", str(WEATHER), str(out))
        return gym(*args, "--limit", "2", "--no-progress", *extra)

    first = weather()
    assert first.returncode == 0, first.stderr
    written = out.read_text()
    math = gym(*collect_args(live["registry"], "math_agent", str(MATH), str(out)), "--limit", "2", "--no-progress")
    assert math.returncode == 1
    assert "holds rollouts of another run" in math.stderr and "the input rows differ" in math.stderr
    assert '--agent was "weather_agent", is "math_agent" now' in math.stderr
    hotter = weather("temperature=0.9")
    assert hotter.returncode == 1
    assert 'the KEY=VALUE overrides were {}, are {"temperature": 0.9} now' in hotter.stderr
    assert out.read_text() == written  # nothing of the refused runs was written
    again = weather("--limit", "3")  # the same run, extended: resumes
    assert again.returncode == 0, again.stderr
    assert "2 already done" in again.stderr and len(read_rows(out)) == 3
    forced = weather("temperature=0.9", "--force")
    assert forced.returncode == 0, forced.stderr
    recorded = json.loads((tmp_path / "rollouts.run.json").read_text())
    assert recorded["overrides"] == {"temperature": 0.9} and recorded["agent"] == "weather_agent"


def test_a_mistyped_option_is_refused_with_a_suggestion_not_taken_as_an_override_or_a_path(tmp_path):
    out = str(tmp_path / "out.jsonl")
    collect = gym("collect", "--input", str(WEATHER), "--output", out, "--num-repeat", "4")
    assert collect.returncode == 2
    assert "No such option '--num-repeat'. Did you mean '--num-repeats'?" in collect.stderr
    run = gym("run", str(REPO / "configs" / "quickstart.yaml"), "--registy", "127.0.0.1:1")
    assert run.returncode == 2 and "No such option '--registy'. Did you mean '--registry'?" in run.stderr
    dump = gym("dump-config", str(REPO / "configs" / "quickstart.yaml"), "--env-fil", "x")
    assert dump.returncode == 2 and "Did you mean '--env-file'?" in dump.stderr
    assert not Path(out).exists()


def test_each_verb_is_the_command_of_its_name_and_imports_no_other_verb():
    """The verbs are imported when used (gym_grpc/cli/app.py): each name leads to the command of
    that name, and a verb that runs loads its own module only."""
    from gym_grpc.cli.app import VERBS, main

    ctx = main.make_context("gym-grpc", ["--help"], resilient_parsing=True)
    for name in VERBS:
        assert main.get_command(ctx, name).name == name
    code = (
        "import sys; from gym_grpc.cli.app import main; main(['status', '--help'], standalone_mode=False); "
        "print(sorted(m for m in sys.modules if m.startswith('gym_grpc.cli.') and m != 'gym_grpc.cli.app'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['gym_grpc.cli.options', 'gym_grpc.cli.status']"
    unknown = gym("colect")
    assert unknown.returncode == 2 and "No such command 'colect'" in unknown.stderr


def test_collect_without_verifying_then_reverify(live, tmp_path):
    out, scored = tmp_path / "unverified.jsonl", tmp_path / "scored.jsonl"
    done = gym(
        *collect_args(live["registry"], "math_agent", str(MATH), str(out)),
        "--skip-verify",
        "--no-progress",
        "--estimate",
        "5000",
    )
    assert done.returncode == 0, done.stderr
    assert "rollouts are not verified yet" in done.stderr
    assert "tokens/s:" in done.stderr and "slowest stage:" in done.stderr
    assert "at this rate 5,000 more rollouts take" in done.stderr
    assert all(row["verification_skipped"] for row in read_rows(out))
    done = gym("reverify", str(out), "--out", str(scored), "--registry", live["registry"], "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "6 rollouts re-verified" in done.stderr and "no row had a verified reward before" in done.stderr
    metrics = json.loads(done.stdout)["math_agent"]
    assert metrics["rollouts"] == 6 and 0 <= metrics["reward"] <= 1 and "unverified" not in metrics
    again = gym("reverify", str(scored), "--output", str(tmp_path / "again.jsonl"), "--registry", live["registry"])
    assert "0 of 6 rewards changed" in again.stderr  # the same verifier agrees with itself


def test_collect_reports_a_bad_row_by_line_and_collects_the_rest(live, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    good = json.dumps({"responses_create_params": {"input": "What is 2 + 2?"}, "expected_answer": "4"})
    bad = json.dumps({"responses_create_params": {"input": [{"role": "robot", "content": "hi"}]}})
    deep = '{"responses_create_params": {"input": "hi"}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    text = "\n".join([good, bad, "{not json", good]) + "\n"
    tasks.write_bytes(text.encode() + b'{"bad": "\xff"}\n' + f"{deep}\n{good}\n".encode())
    out = tmp_path / "rollouts.jsonl"
    done = gym(
        *collect_args(live["registry"], "math_agent", str(tasks), str(out)),
        "--no-progress",
    )
    assert done.returncode == 1
    assert f"{tasks}:2: responses_create_params.input[0].role" in done.stderr  # the first is told at once
    assert f"bad rows in {tasks}: 4\n" in done.stderr  # and how many in all
    assert "4 input rows could not be used" in done.stderr and "running again will not change that" in done.stderr
    assert "retry them" not in done.stderr  # no rollout failed: a re-run would change nothing
    failures = {row["line"]: row["error"]["message"] for row in read_rows(tmp_path / "rollouts.failures.jsonl")}
    assert sorted(failures) == [2, 3, 5, 6] and failures[3].startswith("not JSON") and "not UTF-8" in failures[5]
    assert failures[6].startswith("nested deeper than 32 levels")
    assert sorted(row["task_index"] for row in read_rows(out)) == [0, 3, 6]


def test_collect_with_an_unknown_agent_names_the_known_ones(live, tmp_path):
    done = gym(
        *collect_args(live["registry"], "math_agnt", str(MATH), str(tmp_path / "out.jsonl")),
    )
    assert done.returncode == 1
    assert "did you mean 'math_agent'" in done.stderr


@pytest.mark.parametrize("command", ["collect", "reverify"])
def test_without_a_running_registry_collect_and_reverify_say_so_once(command, tmp_path):
    """Rows that name their own agent (no --agent) still get one clear error, not one failure per row."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "a"}, "response": {}}) + "\n"
    )
    io = ["--input", str(rows), "--output"] if command == "collect" else [str(rows), "--out"]
    done = gym(command, "--registry", "127.0.0.1:1", *io, str(tmp_path / "out.jsonl"), "--no-progress")
    assert done.returncode == 1
    assert "is `gym-grpc run` up with its registry at 127.0.0.1:1?" in done.stderr
    assert not (tmp_path / "out.failures.jsonl").exists()


def test_ctrl_c_stops_every_server(live):
    process = live["process"]
    addresses = list(live["servers"].values())
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    for address in addresses:
        done = subprocess.run(
            [tool("grpcurl"), "-plaintext", "-max-time", "2", address, "list"], capture_output=True, text=True
        )
        assert done.returncode != 0  # nothing answers any more


@pytest.mark.slow
def test_ctrl_c_at_once_after_the_ready_line_stops_every_server_in_order():
    """A signal right after the ready line (a program that starts a run and stops it) used to come
    before the handler was installed: "Aborted!", exit 1, one run in four here, once a run that did not
    end within 60 s in CI. Ten runs, each stopped as soon as it is ready: every one ends 0, its servers with it.
    The race is the runner's, so the runs serve the one model server of local_policy.yaml, which
    starts in a third of the quickstart's time (two workers of five servers)."""
    for _ in range(10):
        run = start_run(configs=(REPO / "configs" / "local_policy.yaml",))
        pids = [pid for name in run.servers for pid in run.pids(name)]
        assert run.stop() == 0, run.log()[-2000:]
        assert "Aborted!" not in run.log()
        assert not [pid for pid in pids if alive(pid)]


@pytest.mark.slow
def test_ctrl_c_while_a_server_is_starting_stops_the_run_and_the_server_at_once(tmp_path):
    """A server whose start does not end (a model loading for minutes, an engine that does not answer)
    kept `gym-grpc run` deaf to Ctrl-C until its start-up time-out (120 s), and then its process deaf
    to the SIGTERM that stops it, until killed after the grace period (15 s)."""
    started = tmp_path / "started"
    config = one_server_config(
        tmp_path, "hanging", "tests/programs/hanging_env.py:HangingEnv", {"started_file": str(started)}
    )
    run = subprocess.Popen(
        [tool("gym-grpc"), "run", str(config), "--registry", "127.0.0.1:0"], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120  # a bound on a hang, not a timing claim
        while not started.exists():  # the server's process waits in its start
            assert run.poll() is None and time.monotonic() < deadline, "the server's start never began"
            time.sleep(0.05)
        workers = descendants(run.pid)
        run.send_signal(signal.SIGINT)
        _, said = run.communicate(timeout=120)
        assert run.returncode == 128 + signal.SIGINT, said
        assert "stopped before every server was ready" in said
        assert "did not stop in time" not in said  # the server's process stopped when told to
        assert [pid for pid in workers if alive(pid)] == []
    finally:
        run.kill()
        run.wait()


@pytest.mark.slow
def test_a_collector_killed_mid_run_resumes_with_every_key_exactly_once(tmp_path):
    run = start_run("servers.policy_model.config.latency_seconds=0.05")
    try:
        tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
        tasks.write_text("".join(MATH.read_text() for _ in range(10)))  # 60 tasks
        args = [
            tool("gym-grpc"),
            *collect_args(run.registry, "math_agent", str(tasks), str(out)),
            "--num-repeats",
            "4",
            "--max-in-flight",
            "8",
            "--no-progress",
        ]
        collector = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        while not out.exists() or len(out.read_bytes().splitlines()) < 40:
            time.sleep(0.02)
        collector.kill()  # SIGKILL: no chance to clean up
        collector.wait()
        written = len(out.read_text().splitlines())
        assert 40 <= written < 240
        again = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        keys = [(row["task_index"], row["repeat_index"]) for row in read_rows(out)]
        assert sorted(keys) == [(t, k) for t in range(60) for k in range(4)]
        assert json.loads(again.stdout)["math_agent"]["rollouts"] == 240
    finally:
        run.stop()


@pytest.mark.slow
def test_sigint_stops_a_background_collect_with_130_and_says_how_to_resume(tmp_path):
    """The collector starts with SIGINT ignored, as a shell starts a background job (`&`).
    240 rollouts, 8 at a time, 0.2 s each: the run lasts 6 s, and is stopped after 20."""
    run = start_run("servers.policy_model.config.latency_seconds=0.2")
    try:
        tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
        tasks.write_text("".join(MATH.read_text() for _ in range(10)))
        args = [tool("gym-grpc"), *collect_args(run.registry, "math_agent", str(tasks), str(out)), "--no-progress"]
        ignoring = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
        collector = subprocess.Popen(
            [*args, "--num-repeats", "4", "--max-in-flight", "8"],
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ignoring,
        )
        while not out.exists() or len(out.read_bytes().splitlines()) < 20:
            time.sleep(0.02)
        collector.send_signal(signal.SIGINT)
        _, stderr = collector.communicate(timeout=60)
        assert collector.returncode == 130, stderr
        held = len(out.read_text().splitlines())
        assert held < 240
        assert f"interrupted; {held:,} rows are in {out}" in stderr and "run the same command again" in stderr
    finally:
        run.stop()


FULL_DISK_SCRIPT = """
disk="$1"; shift
mount -t tmpfs -o size=2m tmpfs "$disk" || exit 90
dd if=/dev/zero of="$disk/filler" bs=1k count=1792 2>/dev/null  # 256 KiB left: room for some rows only
"$@" 2> first.log; echo $? > first.rc
cp "$disk/out.jsonl" first.jsonl
rm "$disk/filler"
"$@" 2> second.log; echo $? > second.rc
cp "$disk/out.jsonl" second.jsonl
"""


@pytest.mark.slow
def test_a_full_disk_stops_collect_with_one_error_and_the_same_command_resumes_after_space_is_freed(tmp_path):
    """A real full disk: a 2 MiB tmpfs, mounted in a private mount namespace (`unshare --mount
    --map-root-user`: root, or unprivileged user namespaces, is needed). The tmpfs ends with
    the namespace, so both collects run in one script inside it, space being freed between
    them by deleting a filler file; what the test checks is copied out."""
    run = start_run()
    try:
        tasks, disk = tmp_path / "tasks.jsonl", tmp_path / "disk"
        tasks.write_text(WEATHER.read_text() * 20)  # 100 rows of about 7 KB: more than 256 KiB
        disk.mkdir()
        (tmp_path / "full.sh").write_text(FULL_DISK_SCRIPT)
        args = ["--registry", run.registry, "--agent", "weather_agent", "--input", str(tasks), "--no-progress"]
        done = subprocess.run(
            ["unshare", "--mount", "--map-root-user", "sh", "full.sh", str(disk)]
            + [tool("gym-grpc"), "collect", *args, "--output", str(disk / "out.jsonl")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode == 90 or "unshare failed" in done.stderr:
            pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {done.stderr.strip()}")
        first_log = (tmp_path / "first.log").read_text()
        assert (tmp_path / "first.rc").read_text().strip() == "1", first_log
        (error,) = first_log.splitlines()  # one clear line, no traceback
        assert "out.jsonl: No space left on device" in error and "run the same command again" in error
        first = (tmp_path / "first.jsonl").read_text()
        assert first.endswith("\n") and 0 < len(read_rows(tmp_path / "first.jsonl")) < 100  # no torn row
        second_log = (tmp_path / "second.log").read_text()
        assert (tmp_path / "second.rc").read_text().strip() == "0", second_log
        second = (tmp_path / "second.jsonl").read_text()
        assert second.startswith(first)  # nothing written before is lost
        keys = sorted((row["task_index"], row["repeat_index"]) for row in read_rows(tmp_path / "second.jsonl"))
        assert keys == [(t, 0) for t in range(100)]
        assert f"{len(first.splitlines())} already done" in second_log
    finally:
        run.stop()


UNWRITABLE_SCRIPT = """
mkdir ro full
mount -t tmpfs -o size=1m,ro tmpfs ro || exit 90
mount -t tmpfs -o size=64k tmpfs full || exit 90
dd if=/dev/zero of=full/filler bs=1k count=64 2>/dev/null  # no room left at all
"$@" --output ro/out.jsonl 2> ro.log; echo $? > ro.rc
"$@" --output full/out.jsonl 2> full.log; echo $? > full.rc
"""


@pytest.mark.slow
def test_an_output_that_cannot_be_written_from_the_start_is_one_error_line(tmp_path):
    """A read-only place and a disk already full (tmpfs mounts in a private mount namespace, as the
    full-disk test makes them): collect says so in one line, no traceback, and exits 1."""
    (tmp_path / "unwritable.sh").write_text(UNWRITABLE_SCRIPT)
    with start_run() as run:
        args = ["--registry", run.registry, "--agent", "weather_agent", "--input", str(WEATHER), "--no-progress"]
        done = subprocess.run(
            ["unshare", "--mount", "--map-root-user", "sh", "unwritable.sh", tool("gym-grpc"), "collect", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    if done.returncode == 90 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {done.stderr.strip()}")
    for place, cause in (("ro", "Read-only file system"), ("full", "No space left on device")):
        log = (tmp_path / f"{place}.log").read_text()
        assert (tmp_path / f"{place}.rc").read_text().strip() == "1", log
        (error,) = log.splitlines()  # one clear line, no traceback
        assert error.startswith("Error: ") and f"{place}/out" in error and cause in error


@pytest.mark.slow
def test_num_workers_serve_one_port_and_share_the_calls(tmp_path):
    run = start_run("layout=per_server", "servers.policy_model.num_workers=2")
    try:
        assert "servers healthy" in run.log() and "(6 processes)" in run.log()
        model = json.loads(grpcurl("-d", '{"name": "policy_model"}', run.registry, "gym.v1.RegistryService/GetServer"))
        assert model["server"]["workers"] == 2
        workers = listening_pids(int(model["server"]["addresses"][0].rsplit(":", 1)[1]))
        assert len(workers) == 2
        before = {pid: cpu_ticks(pid) for pid in workers}
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(WEATHER.read_text() for _ in range(100)))
        out = tmp_path / "out.jsonl"
        done = gym(
            *collect_args(run.registry, "weather_agent", str(tasks), str(out)),
            "--no-progress",
        )
        assert done.returncode == 0, done.stderr
        used = {pid: cpu_ticks(pid) - before[pid] for pid in workers}
        assert all(ticks > 0 for ticks in used.values()), used  # both workers answered model calls
    finally:
        run.stop()


@pytest.mark.slow
def test_a_server_that_dies_is_shown_down_and_the_others_keep_serving(tmp_path):
    run = start_run("layout=per_server")  # grouped, the weather's process serves every server
    try:
        code, rows = run_status(run.registry)
        assert code == 0 and all(row["health"] == "serving" and row["pid"] > 0 for row in rows.values())
        os.kill(rows["weather"]["pid"], signal.SIGKILL)
        for _ in range(100):
            code, rows = run_status(run.registry)
            if rows["weather"]["health"] == "down":
                break
            time.sleep(0.1)
        assert code == 1 and rows["weather"]["health"] == "down" and "pid" not in rows["weather"]
        assert all(row["health"] == "serving" for name, row in rows.items() if name != "weather")
        done = gym(
            *collect_args(run.registry, "math_agent", str(MATH), str(tmp_path / "out.jsonl")),
            "--no-progress",
        )
        assert done.returncode == 0, done.stderr  # the math side still works
        run.process.send_signal(signal.SIGINT)
        assert run.process.wait(timeout=30) == 1  # a server died during the run
        assert "server 'weather'" in run.log()
    finally:
        run.stop()  # a no-op when the test got to stop it


def test_a_reference_to_a_missing_server_fails_startup_naming_the_closest(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(
        f"include: [{REPO / 'configs' / 'local_policy.yaml'}]\n"
        "servers:\n"
        "  weather:\n"
        f"    entrypoint: {REPO / 'servers/resources/weather/server.py'}:WeatherEnv\n"
        "  agent:\n"
        f"    entrypoint: {REPO / 'servers/agents/simple_agent/agent.py'}:SimpleAgent\n"
        "    config: {model_server: polcy_model, resources_server: weather}\n"
    )
    began = time.monotonic()
    done = gym("run", str(config), "registry.port=0")
    assert done.returncode == 1
    assert "calls model server 'polcy_model'" in done.stderr and "did you mean 'policy_model'" in done.stderr
    assert time.monotonic() - began < 60
