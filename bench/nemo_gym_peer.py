"""gym-grpc beside the real NeMo Gym, in one run, on one engine: `python bench/run.py --peer nemo-gym`.

One bench/instant_engine.py process answers both stacks. Each workload runs through
gym-grpc (`gym-grpc run`, its vllm_model on the Chat Completions path, `gym-grpc collect`),
twice: with a process per server, then with the agent, its model server and its
environment in one process group (`process: rollout`, calls between them in-process) run
by one worker process per core (`num_workers`); and then
through NeMo Gym 0.7.0 (`gym env start` with the configurations in
bench/peer/nemo_gym/, its own vllm_model, simple agent and environments, `gym eval run
--no-serve`), each stack started for that workload alone and stopped after it:

  weather     one tool call, then the answer (2 model calls per rollout)
  multi_turn  "[3 tool calls]": the engine calls the tool until 3 outputs are in, then answers (4)
  math        "What is A + B?", answered as \\boxed{\\frac{2(A+B)}{2}} and checked by math-verify (1)

Per stack, workload and window of rollouts in flight: rollouts/s, failures, mean reward,
model calls per rollout, and the CPU time of every process of the stack (the supervisor,
every server and what it started: worker processes, Ray; children that ended are counted
through their parent's cutime) plus the collector's, per rollout; the time to ready; idle
processes and RSS. The wall time runs from the first model call the engine sees to the
collector's exit (so each collector's interpreter start-up is left out the same way, and
the verification of the last rollouts and the writing of the output are in).

NeMo Gym is installed once into its own virtualenv, cached (GYM_GRPC_BENCH_CACHE, default
~/.cache/gym-grpc-bench):

    python3.13 -m venv nemo-gym-0.7.0-venv                 # pyenv's 3.13.0
    nemo-gym-0.7.0-venv/bin/pip install --ignore-requires-python nemo-gym==0.7.0 math-verify==0.8.0

`--ignore-requires-python` because its metadata asks for Python >= 3.13.14; math-verify
is what its math environment's requirements.txt adds. NeMo Gym runs every server from a
virtualenv of its own that it builds with uv from the server's requirements; given
`skip_venv_if_present=true` it uses one that is already there, so each server's venv
(under `uv_venv_dir`) is a link to this one virtualenv. The results record all of this
and the versions installed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import run as bench

NEMO_GYM = "nemo-gym==0.7.0"
EXTRAS = ("math-verify==0.8.0",)  # math_with_judge's requirements.txt, beside the package's own dependencies
CACHE = Path(os.environ.get("GYM_GRPC_BENCH_CACHE", Path.home() / ".cache" / "gym-grpc-bench"))
VENV = CACHE / f"{NEMO_GYM.replace('==', '-')}-venv"
SERVER_VENVS = CACHE / f"{NEMO_GYM.replace('==', '-')}-server-venvs"
#: The NeMo Gym servers the configurations start (the legacy_agent relay NeMo Gym adds to each agent).
SERVERS = [
    "responses_api_models/vllm_model",
    "responses_api_agents/simple_agent",
    "resources_servers/example_single_tool_call",
    "resources_servers/math_with_judge",
    "environment_servers/legacy_agent",
]
PEER = bench.REPO / "bench" / "peer" / "nemo_gym"
VERSIONS = ("nemo-gym", "ray", "fastapi", "uvicorn", "aiohttp", "openai", "pydantic", "math-verify", "sympy")
MULTI_TURN_TOOL_CALLS = 3
WORKLOADS = ("weather", "multi_turn", "math")


def python313() -> str:
    """A Python 3.13: $GYM_GRPC_PYTHON313, pyenv's, or one on PATH."""
    candidates = [os.environ.get("GYM_GRPC_PYTHON313")]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.13*/bin/python3.13")))
    candidates.append(shutil.which("python3.13"))
    for candidate in filter(None, candidates):
        probe = [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 13)"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return candidate
    raise SystemExit("NeMo Gym 0.7.0 needs Python 3.13: set GYM_GRPC_PYTHON313 or install it with pyenv")


def _step(command: list[str]) -> list[str]:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return command


def install() -> dict:
    """NeMo Gym in its own virtualenv, built on first use; how it was installed."""
    record = VENV / "installed.json"
    if record.exists():
        return json.loads(record.read_text())
    shutil.rmtree(VENV, ignore_errors=True)
    interpreter = python313()
    print(f"installing {NEMO_GYM} into {VENV} (once; several minutes) ...", file=sys.stderr)
    python = str(VENV / "bin" / "python")
    commands = [
        _step([interpreter, "-m", "venv", str(VENV)]),
        _step([python, "-m", "pip", "install", "-q", "--ignore-requires-python", NEMO_GYM, *EXTRAS]),
    ]
    for server in SERVERS:  # what skip_venv_if_present finds under uv_venv_dir
        link = SERVER_VENVS / server / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(VENV)
    listed = json.loads(_run_text([python, "-m", "pip", "list", "--format=json"]))
    versions = {p["name"].lower(): p["version"] for p in listed}
    info = {
        "python": _run_text([python, "-c", "import platform; print(platform.python_version())"]).strip(),
        "interpreter": interpreter,
        "commands": [" ".join(c) for c in commands],
        "server_virtualenvs": f"{SERVER_VENVS}/<type>/<name>/.venv -> {VENV}, with skip_venv_if_present=true",
        "versions": {name: versions.get(name) for name in VERSIONS},
        "packages_installed": len(listed),
    }
    record.write_text(json.dumps(info, indent=2) + "\n")
    return info


def _run_text(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_cpu(root: int) -> float:
    """CPU seconds of `root` and every process under it, with the children each has reaped."""
    total = 0.0
    for pid in bench._descendants([root]):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone; its parent's cutime has it
        total += sum(int(x) for x in fields[11:15]) / bench.TICKS
    return total


def _tree_memory(root: int) -> tuple[int, float]:
    pids = bench._descendants([root])
    rss = 0.0
    for pid in pids:
        try:
            rss += bench._memory_mb(pid, "VmRSS")
        except OSError:
            pass
    return len(pids), round(rss, 1)


def nemo_gym_env(tmp: Path) -> dict[str, str]:
    """The environment of NeMo Gym's processes: Ray in a directory of this run's own. (NeMo Gym's
    `ray.init()` joins any Ray cluster it finds under /tmp/ray, such as another benchmark's, and
    fails if that one runs another Python.)"""
    (tmp / "ray").mkdir(exist_ok=True)
    return {**os.environ, "RAY_TMPDIR": str(tmp / "ray")}


class NemoGymStack:
    """`gym env start` of the given configurations, ready when its head server says so."""

    def __init__(self, tmp: Path, configs: list[str], engine_url: str, log: Path) -> None:
        self.head = f"127.0.0.1:{_free_port()}"
        host, port = self.head.split(":")
        self.overrides = [f"++head_server.host={host}", f"++head_server.port={port}"]
        paths = ",".join(str(PEER / c) for c in configs)
        command = [
            str(VENV / "bin" / "gym"),
            "env",
            "start",
            f"+config_paths=[{paths}]",
            f"+policy_base_url={engine_url}",
            "++skip_venv_if_present=true",
            f"++uv_venv_dir={SERVER_VENVS}",
            *self.overrides,
        ]
        started = time.monotonic()
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                command, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=nemo_gym_env(tmp)
            )
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"gym env start exited:\n{log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.head}/readyz", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - started > 900:
                raise RuntimeError(f"gym env start not ready after 900 s:\n{log.read_text()[-5000:]}")
            time.sleep(0.2)
        self.ready_seconds = time.monotonic() - started

    def cpu(self) -> float:
        return _tree_cpu(self.process.pid)

    def stop(self) -> None:
        pids = bench._descendants([self.process.pid])
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for pid in pids[1:]:  # what it left behind (it shuts Ray and its servers down itself)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class GymGrpcStack(bench.Stack):
    def cpu(self) -> float:
        return _tree_cpu(self.process.pid)


#: gym-grpc's two ways to run the same servers: a process each, or the three in one process
#: group (`process:`, whose agent calls its model server and environment in-process), with
#: a worker process per core (`num_workers`: the collector's connections are spread over them).
GYM_GRPC_STACKS = ("gym_grpc", "gym_grpc_grouped")


def _gym_grpc_config(tmp: Path, workload: str, engine_url: str, grouped: bool = False) -> Path:
    agent = f"{bench.REPO}/servers/agents/simple_agent/agent.py:SimpleAgent"
    model = {
        "entrypoint": f"{bench.REPO}/servers/models/vllm_model/server.py:VLLMModel",
        # The Chat Completions path with token ids, as NeMo Gym's vllm_model is configured here.
        "config": {
            "base_url": engine_url,
            "model": "instant",
            "max_connections": 0,
            "return_token_ids": True,
            "token_in_token_out": False,
        },
    }
    if workload == "math":
        env = {
            "entrypoint": f"{bench.REPO}/servers/resources/math/server.py:MathEnv",
            "config": {"verify_workers": os.cpu_count() or 1},
        }
    else:
        env = {"entrypoint": f"{bench.REPO}/servers/resources/weather/server.py:WeatherEnv"}
    servers = {
        "policy_model": model,
        "env": env,
        "agent": {"entrypoint": agent, "config": {"model_server": "policy_model", "resources_server": "env"}},
    }
    if grouped:
        for server in servers.values():
            server.update(process="rollout", num_workers=os.cpu_count() or 1)
    path = tmp / f"peer_gym_grpc_{workload}{'_grouped' if grouped else ''}.yaml"
    path.write_text(json.dumps({"registry": {"port": 0}, "servers": servers}))
    return path


def task_rows(workload: str, count: int) -> list[dict]:
    """The same rows for both stacks: gym-grpc's weather tasks (a tool NeMo Gym's weather
    environment also serves), with "[N tool calls]" for multi-turn; sums for math."""
    if workload == "math":
        rows = []
        for i in range(count):
            a, b = (37 * i) % 1000, (91 * i + 13) % 1000
            question = f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
            rows.append(
                {
                    "responses_create_params": {"input": [{"role": "user", "content": question}]},
                    "question": question,
                    "expected_answer": str(a + b),
                }
            )
        return rows
    rows = []
    for i in range(count):
        row = json.loads(json.dumps(bench.WEATHER_ROWS[i % len(bench.WEATHER_ROWS)]))
        if workload == "multi_turn":
            message = row["responses_create_params"]["input"][-1]
            message["content"] = f"[{MULTI_TURN_TOOL_CALLS} tool calls] {message['content']}"
        rows.append(row)
    return rows


def _engine(engine: bench.InstantEngine, path: str, post: bool = False) -> dict:
    request = urllib.request.Request(engine.url.removesuffix("/v1") + path, method="POST" if post else "GET")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _rewards(out: Path) -> list[float]:
    if not out.exists():
        return []
    rewards = []
    for line in out.read_text().splitlines():
        if line.strip():
            rewards.append(float(json.loads(line).get("reward") or 0.0))
    return rewards


def _measure(
    engine: bench.InstantEngine, stack, command: list[str], out: Path, tasks: int, cwd: Path, env: dict | None = None
) -> dict:
    """Run one collector to the end and measure the stack around it."""
    out.unlink(missing_ok=True)
    _engine(engine, "/bench/reset", post=True)
    before, engine_before = stack.cpu(), engine.cpu()
    started = time.time()
    with (cwd / "collector.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:  # interrupted: the collector goes too
            process.kill()
            process.wait()
            raise
    ended = time.time()
    cpu = stack.cpu() - before + usage.ru_utime + usage.ru_stime
    stats = _engine(engine, "/bench/stats")
    rewards = _rewards(out)
    done = len(rewards)
    seconds = ended - (stats["first"] or started)
    return {
        "rollouts": done,
        "failed": tasks - done,
        "exit_code": os.waitstatus_to_exitcode(status),
        "seconds": round(seconds, 2),
        "collector_start_seconds": round((stats["first"] or ended) - started, 2),
        "rollouts_per_second": round(done / seconds, 1) if done else 0.0,
        "cpu_ms_per_rollout": round(1000 * cpu / max(done, 1), 2),
        "collector_cpu_ms_per_rollout": round(1000 * (usage.ru_utime + usage.ru_stime) / max(done, 1), 2),
        "engine_cpu_ms_per_rollout": round(1000 * (engine.cpu() - engine_before) / max(done, 1), 2),
        "model_calls_per_rollout": round(stats["calls"] / max(done, 1), 2),
        "mean_reward": round(sum(rewards) / done, 3) if done else None,
    }


def _log_tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


def _median_run(measured: list[dict]) -> dict:
    """The run of median rollouts/s among repeats (the lower middle of an even count), with
    every repeat's rollouts/s beside it and the failures of all of them."""
    row = dict(sorted(measured, key=lambda run: run["rollouts_per_second"])[(len(measured) - 1) // 2])
    row["failed"] = sum(run["failed"] for run in measured)
    row["rollouts_per_second_each"] = [run["rollouts_per_second"] for run in measured]
    return row


def bench_workload(
    tmp: Path, engine: bench.InstantEngine, workload: str, windows: list[int], sizes: dict, repeats: int
) -> dict:
    """One workload through gym-grpc (a process per server, then all in one process group), then
    through NeMo Gym, at each window, `repeats` times each (the median run is kept)."""
    runs: dict[str, list[dict]] = {name: [] for name in (*GYM_GRPC_STACKS, "nemo_gym")}
    ready: dict[str, float] = {}
    idle: dict[str, dict] = {}
    task_files = {}
    for window in windows:
        count = sizes[window]
        task_files[window] = (bench._tasks(tmp, f"peer_{workload}", task_rows(workload, count), count), count)

    def each_window(stack: Any, name: str, command_for: Any, env: dict[str, str] | None = None) -> None:
        """Collect every window's tasks through one started stack (stopped after), as `name`."""
        try:
            ready[name] = round(stack.ready_seconds, 2)
            processes, rss = _tree_memory(stack.process.pid)
            idle[name] = {"processes": processes, "rss_mb": rss}
            for window in windows:
                tasks, count = task_files[window]
                out = tmp / f"peer_out_{name}.jsonl"
                command = command_for(tasks, out, window)
                measured = []
                for _ in range(repeats):
                    row = {"in_flight": window, **_measure(engine, stack, command, out, count, tmp, env)}
                    if row["exit_code"] and not row["rollouts"]:
                        raise RuntimeError(f"{name} collect failed:\n{_log_tail(tmp / 'collector.log')}")
                    measured.append(row)
                    print(f"    {row}", file=sys.stderr)
                runs[name].append(_median_run(measured))
        finally:
            stack.stop()

    for name in GYM_GRPC_STACKS:
        print(f"  {workload}: {name} ...", file=sys.stderr)
        stack = GymGrpcStack(_gym_grpc_config(tmp, workload, engine.url, grouped=name != "gym_grpc"))
        each_window(
            stack,
            name,
            lambda tasks, out, window, registry=stack.registry: bench.collect_args(
                registry, "agent", tasks, out, window, "--timeout", "1800"
            ),
        )

    print(f"  {workload}: NeMo Gym ...", file=sys.stderr)
    configs = ["model.yaml", "math.yaml" if workload == "math" else "weather.yaml"]
    agent = "math_agent" if workload == "math" else "weather_agent"
    nemo = NemoGymStack(tmp, configs, engine.url, tmp / f"nemo_gym_{workload}.log")

    def nemo_gym_collect(tasks: Path, out: Path, window: int) -> list[str]:
        command = [str(VENV / "bin" / "gym"), "eval", "run", "--no-serve", *nemo.overrides]
        command += [f"+agent_name={agent}", f"+input_jsonl_fpath={tasks}", f"+output_jsonl_fpath={out}"]
        return command + [f"+num_samples_in_parallel={window}", "+disable_health_check=true"]

    each_window(nemo, "nemo_gym", nemo_gym_collect, nemo_gym_env(tmp))

    rows = []
    for index, theirs in enumerate(runs["nemo_gym"]):
        row: dict[str, Any] = {"in_flight": theirs["in_flight"], "nemo_gym": theirs}
        for name in GYM_GRPC_STACKS:
            ours = row[name] = runs[name][index]
            rate = (
                ours["rollouts_per_second"] / theirs["rollouts_per_second"] if theirs["rollouts_per_second"] else None
            )
            cpu = ours["cpu_ms_per_rollout"] / theirs["cpu_ms_per_rollout"] if theirs["rollouts"] else None
            row[f"ratio_{name}_over_nemo_gym"] = {
                "rollouts_per_second": round(rate, 2) if rate else None,
                "cpu_ms_per_rollout": round(cpu, 3) if cpu else None,
            }
        rows.append(row)
    return {"workload": workload, "ready_seconds": ready, "idle": idle, "runs": rows}


def bench_peer(tmp: Path, windows: list[int], sizes: dict, workloads: list[str], repeats: int, save=None) -> dict:
    """Every workload through both stacks, each window `repeats` times (the median run is
    reported); `save` gets the results so far after each workload."""
    result = {
        "nemo_gym_install": install(),
        "engine": "bench/instant_engine.py, one process for both stacks, no latency",
        "model_server": "vllm_model of each, Chat Completions with token ids",
        "gym_grpc_layouts": {
            "gym_grpc": "a process per server",
            "gym_grpc_grouped": f"the three servers in one process group (process: rollout), "
            f"num_workers: {os.cpu_count() or 1}",
        },
        "repeats": repeats,
        "load_average": {"before": [round(x, 1) for x in os.getloadavg()]},
        "workloads": [],
    }
    engine = bench.InstantEngine(tmp)
    try:
        for workload in workloads:
            result["workloads"].append(bench_workload(tmp, engine, workload, windows, sizes, repeats))
            result["load_average"]["after"] = [round(x, 1) for x in os.getloadavg()]
            if save is not None:
                save(result)
    finally:
        engine.stop()
    return result


def table(result: dict) -> str:
    lines = [
        "| workload | in flight | rollouts/s gym-grpc: a process per server / grouped; NeMo Gym "
        "| ratio to NeMo Gym | CPU ms/rollout: per server / grouped; NeMo Gym | failed | mean reward "
        "| model calls/rollout | ready in |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in result["workloads"]:
        ready = workload["ready_seconds"]
        for row in workload["runs"]:
            ours, grouped, theirs = row["gym_grpc"], row["gym_grpc_grouped"], row["nemo_gym"]
            ratio, ratio_grouped = row["ratio_gym_grpc_over_nemo_gym"], row["ratio_gym_grpc_grouped_over_nemo_gym"]
            lines.append(
                f"| {workload['workload']} | {row['in_flight']:,} "
                f"| {ours['rollouts_per_second']:,} / {grouped['rollouts_per_second']:,}; "
                f"{theirs['rollouts_per_second']:,} "
                f"| {ratio['rollouts_per_second']}x / {ratio_grouped['rollouts_per_second']}x "
                f"| {ours['cpu_ms_per_rollout']} / {grouped['cpu_ms_per_rollout']}; {theirs['cpu_ms_per_rollout']} "
                f"| {ours['failed']} / {grouped['failed']}; {theirs['failed']} "
                f"| {ours['mean_reward']} / {grouped['mean_reward']}; {theirs['mean_reward']} "
                f"| {ours['model_calls_per_rollout']}; {theirs['model_calls_per_rollout']} "
                f"| {ready['gym_grpc']} s / {ready['gym_grpc_grouped']} s; {ready['nemo_gym']} s |"
            )
    idle = "; ".join(
        f"{w['workload']}: "
        + " / ".join(
            f"{w['idle'][name]['processes']} processes {w['idle'][name]['rss_mb']:,} MB"
            for name in (*GYM_GRPC_STACKS, "nemo_gym")
        )
        for w in result["workloads"]
    )
    installed = result["nemo_gym_install"]
    lines.append(f"\nIdle, gym-grpc per server / grouped / NeMo Gym: {idle}.")
    lines.append(
        f"NeMo Gym {installed['versions'].get('nemo-gym')} on Python {installed['python']}: "
        + "; ".join(installed["commands"][1:])
    )
    return "\n".join(lines)
