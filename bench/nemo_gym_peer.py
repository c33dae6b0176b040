"""gym-grpc beside the real NeMo Gym, in one run, on one engine: `python bench/run.py --peer nemo-gym`.

One bench/instant_engine.py process answers both stacks. Each workload runs through gym-grpc
(`gym-grpc run`, its vllm_model, `gym-grpc collect`) in its layouts, and then through NeMo Gym
0.7.0 (`gym env start` with the configurations in bench/peer/nemo_gym/, its own vllm_model,
simple agent and environments, `gym eval run --no-serve`), each stack started for that workload
alone and stopped after it. The gym-grpc layouts:

  default      the configuration as written, with no layout setting: what `gym-grpc run` does
               unless told (the agent with the servers it calls in one process group, run by a
               worker process per core: `group_workers: auto`)
  one_process  the same group in one process (`group_workers: 1`; the default from 2026-11-28
               to 2026-12-01)
  per_server   `layout: per_server`, a process per server (gym-grpc run's default until 2026-11-28)

The workloads (model calls per rollout in brackets):

  weather       one tool call, then the answer (2); Chat Completions with token ids
  multi_turn    "[3 tool calls]": the engine calls the tool until 3 outputs are in, then answers (4)
  math          "What is A + B?", answered as \\boxed{\\frac{2(A+B)}{2}} and checked by math-verify (1)
  tokens        multi_turn on the token path (4): gym-grpc's vllm_model token in / token out (the
                engine's /tokenize renders, twice a turn, /v1/completions generates from the ids;
                the engine renders for both stacks, so the engine's CPU is reported beside); NeMo Gym's
                vllm_model with its training-token capture and exact prefix supply on (its
                on-policy corrections: every call after the first sends the earlier call's ids
                as required_prefix_token_ids, which the engine honours)
  long_horizon  "[15 tool calls]" on the token path, as tokens (16)

Each run collects at least as many rollouts as are in flight; gym-grpc's runs at least 4,000 or
16,000 model calls' worth, whichever is fewer (`GYM_GRPC_ROWS`), NeMo Gym's at least 3,000 model
calls' worth (`NEMO_GYM_MODEL_CALLS`: at its
rates here, 10 s or more; the results say how long each run took). Per stack, workload and
window of rollouts in flight: rollouts/s over the whole run and in its steady state (the model
calls the engine answered between the 10% and the 90% mark of the run's calls, per second, over
the calls per rollout), failures, mean reward, model calls per rollout, and the CPU time of every process of
the stack (the supervisor, every server and what it started: worker processes, Ray; children
that ended are counted through their parent's cutime) plus the collector's, per rollout and per
model call; the time to ready; idle processes and RSS. The wall time runs from the first model
call the engine sees to the collector's exit (so each collector's interpreter start-up is left
out the same way, and the verification of the last rollouts and the writing of the output are
in).

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
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import run as bench

from gym_grpc.launch.config import GymConfig
from gym_grpc.rpc import ports

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
#: Tool calls per rollout asked of the engine ("[N tool calls]"); a rollout makes one model call more.
TOOL_CALLS = {"weather": 1, "multi_turn": 3, "math": 0, "tokens": 3, "long_horizon": 15}
WORKLOADS = tuple(TOOL_CALLS)
#: The workloads on the token path (token in / token out); the others on Chat Completions.
TOKEN_PATH = ("tokens", "long_horizon")
#: Rollouts in flight at which each workload runs (16 calls at 4,096 would keep NeMo Gym ~5 min a run).
WINDOWS = {workload: (64, 1024, 4096) for workload in WORKLOADS} | {"long_horizon": (64, 1024)}
#: Rollouts of each gym-grpc run at least, or its model calls at least, whichever is fewer (and at
#: least the window): 4,000 rollouts of up to 4 calls, 1,000 of 16 (25 s and more here).
GYM_GRPC_ROWS, GYM_GRPC_MODEL_CALLS = 4000, 16000
#: Model calls of each NeMo Gym run at least (and at least the window's rollouts): 10 s and more at its rates here.
NEMO_GYM_MODEL_CALLS = 3000


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

    def __init__(self, tmp: Path, configs: list[str], engine_url: str, log: Path, extra: Sequence[str] = ()) -> None:
        self.head = f"127.0.0.1:{ports.free_port()}"
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
            *extra,
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


#: gym-grpc's layouts of the same servers (see the module's docstring).
GYM_GRPC_STACKS = ("gym_grpc_default", "gym_grpc_per_server", "gym_grpc_one_process")
#: The layouts each workload runs (a process per server only where it was the old default's figure).
LAYOUTS = {
    workload: GYM_GRPC_STACKS if workload in ("weather", "multi_turn", "math") else GYM_GRPC_STACKS[::2]
    for workload in WORKLOADS
}


def _gym_grpc_config(tmp: Path, workload: str, engine_url: str, layout: str = "gym_grpc_per_server") -> Path:
    agent = f"{bench.REPO}/servers/agents/simple_agent/agent.py:SimpleAgent"
    tokens = workload in TOKEN_PATH
    model = {
        "entrypoint": f"{bench.REPO}/servers/models/vllm_model/server.py:VLLMModel",
        # With token ids: on Chat Completions as NeMo Gym's vllm_model is configured here, or token
        # in / token out with the engine's /tokenize rendering the turns (no tokenizer_dir), so that
        # on both stacks the engine renders, as it does for NeMo Gym's token path, and /v1/completions
        # generating from the ids.
        "config": {
            "base_url": engine_url,
            "model": "instant",
            "max_connections": 0,
            "return_token_ids": True,
            "token_in_token_out": tokens,
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
        "agent": {
            "entrypoint": agent,
            "config": {"model_server": "policy_model", "resources_server": "env", "max_steps": 20},
        },
    }
    config: dict[str, Any] = {"registry": {"port": 0}, "servers": servers}
    if layout == "gym_grpc_per_server":
        config["layout"] = "per_server"
    elif layout == "gym_grpc_one_process":
        config["group_workers"] = 1
    path = tmp / f"peer_{layout}_{workload}.yaml"
    path.write_text(json.dumps(config))
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
        if TOOL_CALLS[workload] > 1:
            message = row["responses_create_params"]["input"][-1]
            message["content"] = f"[{TOOL_CALLS[workload]} tool calls] {message['content']}"
        rows.append(row)
    return rows


def rows_per_run(stack: str, workload: str, window: int) -> int:
    """How many rollouts one run of `stack` collects at `window` in flight (see GYM_GRPC_ROWS)."""
    calls = TOOL_CALLS[workload] + 1
    if stack == "nemo_gym":
        return max(window, -(-NEMO_GYM_MODEL_CALLS // calls))
    return max(window, min(GYM_GRPC_ROWS, -(-GYM_GRPC_MODEL_CALLS // calls)))


def steady_rate(times: list[float], calls_per_rollout: float) -> float | None:
    """Rollouts/s in the steady state: the model calls answered between the 10% and the 90% mark of
    the run's calls, per second, over the calls a rollout makes; None with too few to tell. By the
    calls, which flow all the time, rather than by the rollouts finished, which come in waves when
    a run is not many windows long (every rollout of a window ends at about the same time)."""
    times = sorted(times)
    first, last = len(times) // 10, -(-9 * len(times) // 10) - 1
    if last - first < 2 or times[last] <= times[first] or calls_per_rollout <= 0:
        return None
    return (last - first) / (times[last] - times[first]) / calls_per_rollout


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
    steady = steady_rate(stats["times"], stats["calls"] / done) if done else None
    calls = max(stats["calls"], 1)
    return {
        "rollouts": done,
        "failed": tasks - done,
        "exit_code": os.waitstatus_to_exitcode(status),
        "seconds": round(seconds, 2),
        "collector_start_seconds": round((stats["first"] or ended) - started, 2),
        "rollouts_per_second": round(done / seconds, 1) if done else 0.0,
        "steady_rollouts_per_second": round(steady, 1) if steady else None,
        "cpu_ms_per_rollout": round(1000 * cpu / max(done, 1), 2),
        "cpu_ms_per_model_call": round(1000 * cpu / calls, 3),
        "collector_cpu_ms_per_rollout": round(1000 * (usage.ru_utime + usage.ru_stime) / max(done, 1), 2),
        "engine_cpu_ms_per_rollout": round(1000 * (engine.cpu() - engine_before) / max(done, 1), 2),
        "model_calls_per_rollout": round(stats["calls"] / max(done, 1), 2),
        "tokenize_calls_per_rollout": round(stats["tokenize"] / max(done, 1), 2),
        # Calls that sent the ids of the turns before as required_prefix_token_ids (NeMo Gym's prefix supply).
        "prefixed_calls_per_rollout": round(stats["prefixed"] / max(done, 1), 2),
        "mean_reward": round(sum(rewards) / done, 3) if done else None,
    }


def _rate(run: dict) -> float:
    """The rate a run is ranked and compared by: its steady state's, else its whole run's."""
    return run.get("steady_rollouts_per_second") or run["rollouts_per_second"]


def _log_tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


def _median_run(measured: list[dict]) -> dict:
    """The run of median rate (steady state's) among repeats (the lower middle of an even count),
    with every repeat's rates beside it and the failures of all of them."""
    row = bench.median_run(measured, _rate)
    row["failed"] = sum(run["failed"] for run in measured)
    row["rollouts_per_second_each"] = [run["rollouts_per_second"] for run in measured]
    row["steady_rollouts_per_second_each"] = [run.get("steady_rollouts_per_second") for run in measured]
    return row


def _ratio(ours: dict, theirs: dict) -> dict:
    """gym-grpc's figures over NeMo Gym's: rates (steady state and whole run) and CPU."""

    def over(a: float | None, b: float | None, digits: int) -> float | None:
        return round(a / b, digits) if a and b else None

    return {
        "steady_rollouts_per_second": over(
            ours.get("steady_rollouts_per_second"), theirs.get("steady_rollouts_per_second"), 2
        ),
        "rollouts_per_second": over(ours["rollouts_per_second"], theirs["rollouts_per_second"], 2),
        "cpu_ms_per_rollout": over(ours["cpu_ms_per_rollout"], theirs["cpu_ms_per_rollout"], 3),
    }


def bench_workload(
    tmp: Path, engine: bench.InstantEngine, workload: str, windows: list[int], rows_for: Any, repeats: int
) -> dict:
    """One workload through gym-grpc in its layouts, then through NeMo Gym, at each window, `repeats`
    times each (the median run is kept); `rows_for(stack, workload, window)` sizes each run."""
    layouts = LAYOUTS[workload]
    runs: dict[str, list[dict]] = {name: [] for name in (*layouts, "nemo_gym")}
    ready: dict[str, float] = {}
    idle: dict[str, dict] = {}

    def each_window(stack: Any, name: str, command_for: Any, env: dict[str, str] | None = None) -> None:
        """Collect every window's tasks through one started stack (stopped after), as `name`."""
        try:
            ready[name] = round(stack.ready_seconds, 2)
            processes, rss = _tree_memory(stack.process.pid)
            idle[name] = {"processes": processes, "rss_mb": rss}
            for window in windows:
                count = rows_for(name, workload, window)
                tasks = bench._tasks(tmp, f"peer_{workload}_{count}", task_rows(workload, count), count)
                out = tmp / f"peer_out_{name}.jsonl"
                command = command_for(tasks, out, window)
                measured = []
                for _ in range(repeats):
                    row = {"in_flight": window, **_measure(engine, stack, command, out, count, tmp, env)}
                    if row["exit_code"] and not row["rollouts"]:
                        raise RuntimeError(f"{name} collect failed:\n{_log_tail(tmp / 'collector.log')}")
                    measured.append(row)
                    print(f"    {name} {row}", file=sys.stderr)
                runs[name].append(_median_run(measured))
        finally:
            stack.stop()

    for name in layouts:
        print(f"  {workload}: {name} ...", file=sys.stderr)
        stack = GymGrpcStack(_gym_grpc_config(tmp, workload, engine.url, name))
        each_window(
            stack,
            name,
            lambda tasks, out, window, registry=stack.registry: bench.collect_args(
                registry, "agent", tasks, out, window, "--timeout", "1800"
            ),
        )

    print(f"  {workload}: NeMo Gym ...", file=sys.stderr)
    model = "model_tokens.yaml" if workload in TOKEN_PATH else "model.yaml"
    configs = [model, "math.yaml" if workload == "math" else "weather.yaml"]
    agent = "math_agent" if workload == "math" else "weather_agent"
    captures = tmp / f"nemo_gym_captures_{workload}"
    nemo = NemoGymStack(tmp, configs, engine.url, tmp / f"nemo_gym_{workload}.log", [f"+capture_dir={captures}"])

    def nemo_gym_collect(tasks: Path, out: Path, window: int) -> list[str]:
        command = [str(VENV / "bin" / "gym"), "eval", "run", "--no-serve", *nemo.overrides]
        command += [f"+agent_name={agent}", f"+input_jsonl_fpath={tasks}", f"+output_jsonl_fpath={out}"]
        return command + [f"+num_samples_in_parallel={window}", "+disable_health_check=true"]

    each_window(nemo, "nemo_gym", nemo_gym_collect, nemo_gym_env(tmp))

    rows = []
    for index, theirs in enumerate(runs["nemo_gym"]):
        row: dict[str, Any] = {"in_flight": theirs["in_flight"], "nemo_gym": theirs}
        for name in layouts:
            row[name] = runs[name][index]
            row[f"ratio_{name}_over_nemo_gym"] = _ratio(row[name], theirs)
        rows.append(row)
    return {
        "workload": workload,
        "model_calls": TOOL_CALLS[workload] + 1,
        "path": "token in / token out" if workload in TOKEN_PATH else "Chat Completions with token ids",
        "layouts": list(layouts),
        "ready_seconds": ready,
        "idle": idle,
        "runs": rows,
    }


def bench_peer(
    tmp: Path, windows: dict[str, list[int]], rows_for: Any, workloads: list[str], repeats: int, save=None
) -> dict:
    """Every workload through both stacks, at its windows (`windows[workload]`), each `repeats`
    times (the median run is reported); `save` gets the results so far after each workload."""
    result = {
        "nemo_gym_install": install(),
        "engine": "bench/instant_engine.py, one process for both stacks, no latency",
        "model_server": "vllm_model of each: Chat Completions with token ids, or the token path (tokens, "
        "long_horizon): gym-grpc's token in / token out, NeMo Gym's training-token capture with exact prefix supply",
        "gym_grpc_layouts": {
            "gym_grpc_default": "the configuration with no layout setting (the default: the agent with the "
            f"servers it calls in one process group, run by {GymConfig().workers_per_group} worker processes)",
            "gym_grpc_per_server": "layout: per_server, a process per server",
            "gym_grpc_one_process": "the same group in one process (group_workers: 1)",
        },
        "rows_per_run": {
            "gym_grpc": f"at least {GYM_GRPC_ROWS} rollouts or {GYM_GRPC_MODEL_CALLS} model calls' worth, "
            "whichever is fewer, and the window",
            "nemo_gym": f"at least {NEMO_GYM_MODEL_CALLS} model calls' worth of rollouts and the window",
        },
        "steady_state": "model calls answered between the 10% and the 90% mark of the run's calls, per second, "
        "over the model calls per rollout",
        "repeats": repeats,
        "load_average": {"before": [round(x, 1) for x in os.getloadavg()]},
        "workloads": [],
    }
    engine = bench.InstantEngine(tmp)
    try:
        for workload in workloads:
            result["workloads"].append(bench_workload(tmp, engine, workload, windows[workload], rows_for, repeats))
            result["load_average"]["after"] = [round(x, 1) for x in os.getloadavg()]
            if save is not None:
                save(result)
    finally:
        engine.stop()
    return result


NAMES = {
    "gym_grpc_default": "gym-grpc, default",
    "gym_grpc_per_server": "gym-grpc, per server",
    "gym_grpc_one_process": "gym-grpc, one process",
    "nemo_gym": "NeMo Gym",
}


def table(result: dict) -> str:
    lines = [
        "| workload | in flight | stack | rollouts in | rollouts/s steady (whole run) | ratio to NeMo Gym "
        "| CPU ms per rollout | CPU ms per model call | engine CPU ms per rollout | failed | mean reward |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for workload in result["workloads"]:
        name = f"{workload['workload']} ({workload['model_calls']} calls)"
        for row in workload["runs"]:
            for stack in (*workload["layouts"], "nemo_gym"):
                run = row[stack]
                ratio = row.get(f"ratio_{stack}_over_nemo_gym")
                ratios = f"{ratio['steady_rollouts_per_second']}x ({ratio['rollouts_per_second']}x)" if ratio else ""
                lines.append(
                    f"| {name} | {row['in_flight']:,} | {NAMES[stack]} | {run['rollouts']:,} in {run['seconds']} s "
                    f"| {run['steady_rollouts_per_second']} ({run['rollouts_per_second']}) | {ratios} "
                    f"| {run['cpu_ms_per_rollout']} | {run['cpu_ms_per_model_call']} "
                    f"| {run['engine_cpu_ms_per_rollout']} | {run['failed']} "
                    f"| {run['mean_reward']} |"
                )
        ready = ", ".join(f"{NAMES[stack]} {seconds} s" for stack, seconds in workload["ready_seconds"].items())
        idle = ", ".join(
            f"{NAMES[stack]} {i['processes']} processes in {i['rss_mb']:,} MB" for stack, i in workload["idle"].items()
        )
        notes.append(f"{workload['workload']} ({workload['path']}): ready in {ready}; idle: {idle}.")
    installed = result["nemo_gym_install"]
    lines += ["", *notes]
    lines.append(
        f"NeMo Gym {installed['versions'].get('nemo-gym')} on Python {installed['python']}: "
        + "; ".join(installed["commands"][1:])
    )
    return "\n".join(lines)


def summary(result: dict) -> str:
    """One row per workload and window: each stack's steady rate, the ratios, and CPU per rollout and
    per model call (the table docs/performance.md quotes)."""
    lines = [
        "| workload | in flight | rollouts/s, steady: gym-grpc default / per server / one process; NeMo Gym "
        "| ratio to NeMo Gym: default / per server / one process | CPU ms per rollout (per model call): "
        "default / one process; NeMo Gym |",
        "|---|---|---|---|---|",
    ]

    def each(row: dict, stacks: tuple[str, ...], show: Any) -> str:
        return " / ".join(show(row[stack]) if stack in row else "–" for stack in stacks)

    for workload in result["workloads"]:
        name = f"{workload['workload']} ({workload['model_calls']} calls)"
        for row in workload["runs"]:
            theirs = row["nemo_gym"]
            rates = each(row, GYM_GRPC_STACKS, lambda run: f"{_rate(run):,.0f}")
            ratios = " / ".join(
                f"**{r['steady_rollouts_per_second']}×**" if (r := row.get(f"ratio_{stack}_over_nemo_gym")) else "–"
                for stack in GYM_GRPC_STACKS
            )
            cpu = each(
                row,
                GYM_GRPC_STACKS[::2],
                lambda run: f"{run['cpu_ms_per_rollout']} ({run['cpu_ms_per_model_call']})",
            )
            lines.append(
                f"| {name} | {row['in_flight']:,} | {rates}; {_rate(theirs):,.1f} | {ratios} "
                f"| {cpu}; {theirs['cpu_ms_per_rollout']} ({theirs['cpu_ms_per_model_call']}) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":  # the tables of a results file: python bench/nemo_gym_peer.py RESULTS.json
    loaded = json.loads(Path(sys.argv[1]).read_text())["results"]["peer_nemo_gym"]
    print(summary(loaded), table(loaded), sep="\n\n")
