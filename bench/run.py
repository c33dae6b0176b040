"""Every gym-grpc benchmark, in one run on this machine.

    python bench/run.py                 # the full run, writes bench/results/<name>.json
    python bench/run.py --smoke         # a small run for CI (results in a temp dir)

What it measures, each in real processes on loopback:
  (a) raw_grpc         the limit: grpc.aio unary round trips/s, empty handler, rollout-sized payload
  (b) single_turn      collector -> agent -> model -> resources rollouts/s at windows 64, 1,024, 16,384
      single_tool_call the weather workload (a tool call, then the answer) through the same stack,
                       and through the vllm model server in front of bench/instant_engine.py
  (c) latency_16k      16,384 rollouts in flight against a model with 2 s of latency
  (d) collector_1m     the collector on a 1,000,000-row input (--limit 10,000, then resumed to
                       --limit 50,000), and the servers' memory, idle, after each
                       and one collect of 1,000,000 rollouts, its RSS and time at every 100,000
                       (--only collector_1m runs just that)
  (e) http_engine_16k  16,384 weather rollouts in flight through each HTTP model server (vllm:
                       Chat Completions, openai: Responses) to an engine that answers after 2 s,
                       then 10 s, with --cpu-hogs busy processes loading the machine meanwhile
  (f) replicas         the weather workload on a Ray cluster of three nodes on this machine
                       (ray.cluster_utils), with 1, 2 and 4 replicas of each server, beside
                       the same servers without Ray; calls per replica; and the registry
                       pushing one change to 2,000 watchers (bench/registry_fanout.py)
      startup          `gym-grpc run` of the quickstart, from start to every server healthy
  --only sandboxes     a sandbox per session: start/destroy p50/p99 with and without a warm pool,
                       memory and idle CPU per sandbox with 256 alive, terminal rollouts/s with each
                       task's own solution as the policy (bench/sandboxes.py)
  --only images        bytes on the wire for a 10-turn screenshot rollout (the browser environment in
                       headless Chromium), link by link, beside the same rollout in NeMo Gym's JSON
                       (bench/images.py)
  --only task_sampling rollouts run per GRPO group with signal: a plain sampler beside dynamic sampling,
                       and dynamic sampling with difficulty pools, through a real task server over
                       always-, never- and sometimes-solved math tasks (bench/task_sampling.py)
  --only admission     engine-aware admission on the real CPU vLLM: a too-small and a too-large fixed
                       window beside `collect --admission engine`, same rollouts, engine load sampled
                       (bench/admission.py; --engine-url/--engine-model reuse a running vLLM)
  --peer nemo-gym      (or --only peer) gym-grpc beside the real NeMo Gym 0.7.0 on one engine: the
                       weather (2 model calls) and multi-turn (4) workloads on Chat Completions, and
                       multi-turn (4) and long-horizon (16) on the token path, at 64, 1,024 and 4,096
                       in flight (long-horizon: 64, 1,024), every gym-grpc layout; math on request
                       (bench/nemo_gym_peer.py; results in <name>-peer-nemo-gym.json)
CPU per rollout is the CPU time of every process (servers and collector) divided by the rollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from gym_grpc.engines.local_vllm.process import die_with_parent
from gym_grpc.testing.processes import GymRun, descendants

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TICKS = os.sysconf("SC_CLK_TCK")

SINGLE_TURN_ROW = {"responses_create_params": {"input": "What is 17 + 25?", "temperature": 0}}
WEATHER_ROWS = [json.loads(line) for line in (REPO / "servers/resources/weather/data/example.jsonl").open()]
CART_ROWS = [json.loads(line) for line in (REPO / "servers/resources/session_state/data/example.jsonl").open()]


def _gym() -> str:
    return shutil.which("gym-grpc", path=str(BIN)) or "gym-grpc"


#: For `preexec_fn` of every process a benchmark starts: it gets SIGTERM when the benchmark dies,
#: even by SIGKILL, when no `finally` stops it (Linux's PR_SET_PDEATHSIG). It follows the thread
#: that started the child, so children are started from the main thread.
TIED = die_with_parent if sys.platform == "linux" else None


def stop_on_termination() -> None:
    """Make SIGTERM and SIGHUP end the benchmark as Ctrl-C does, by an exception, so that each
    `finally` stops what it started (stacks, engines, NeMo Gym, a Ray cluster) and removes its
    temporary files. A second signal ends the process at once, as it would have the first time."""

    def stop(signum: int, frame: object) -> None:
        for each in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(each, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    for each in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(each, stop)


def median_run(runs: list[dict], key: Callable[[dict], float]) -> dict:
    """Of a measurement repeated, the run of median `key` (the lower of the two middle ones for an
    even count), copied, so that figures of every run can be set beside it: the run stands for the
    repeats, so that its figures agree with one another, as a median of each figure's would not."""
    return dict(sorted(runs, key=key)[(len(runs) - 1) // 2])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _memory_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _write_config(directory: Path, model_latency: float, engine_url: str | None = None, cart: bool = False) -> Path:
    """The benchmark stack's configuration; `cart` adds the shopping-cart environment (a session a
    rollout, several tool calls) and its agent, `cart_agent`."""
    agent = f"{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent"
    config = {
        "registry": {"port": 0},
        "servers": {
            "policy_model": {
                "entrypoint": f"{REPO}/servers/models/local_policy/server.py:LocalPolicyModel",
                "config": {"latency_seconds": model_latency},
            },
            "trivial": {"entrypoint": f"{REPO}/bench/trivial_env.py:TrivialEnv"},
            "single_turn_agent": {
                "entrypoint": agent,
                "config": {"model_server": "policy_model", "resources_server": "trivial"},
            },
            "weather": {"entrypoint": f"{REPO}/servers/resources/weather/server.py:WeatherEnv"},
            "weather_agent": {
                "entrypoint": agent,
                "config": {"model_server": "policy_model", "resources_server": "weather"},
            },
        },
    }
    if cart:
        config["servers"]["cart"] = {"entrypoint": f"{REPO}/servers/resources/session_state/server.py:ShoppingCartEnv"}
        config["servers"]["cart_agent"] = {
            "entrypoint": agent,
            "config": {"model_server": "policy_model", "resources_server": "cart", "max_steps": 8},
        }
    if engine_url is not None:  # the HTTP model servers in front of bench/instant_engine.py
        # No connection cap: every rollout in flight reaches the engine, whose latency is the point.
        engine = {"base_url": engine_url, "model": "instant", "max_connections": 0}
        config["servers"]["http_policy_model"] = {
            "entrypoint": f"{REPO}/servers/models/vllm_model/server.py:VLLMModel",
            # The Chat Completions path, as NeMo Gym's vLLM model server uses it and as the results
            # so far measured it; instant_engine.py serves no /v1/completions. The token path on a
            # real engine is measured by bench/real_engine.py.
            "config": {**engine, "return_token_ids": True, "token_in_token_out": False},
        }
        config["servers"]["http_weather_agent"] = {
            "entrypoint": agent,
            "config": {"model_server": "http_policy_model", "resources_server": "weather"},
        }
        config["servers"]["responses_policy_model"] = {
            "entrypoint": f"{REPO}/servers/models/openai_model/server.py:OpenAIModel",
            "config": engine,
        }
        config["servers"]["responses_weather_agent"] = {
            "entrypoint": agent,
            "config": {"model_server": "responses_policy_model", "resources_server": "weather"},
        }
    path = directory / f"bench_{model_latency}_{engine_url is not None}_{cart}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


class InstantEngine:
    """bench/instant_engine.py in its own process, answering after `latency` seconds."""

    def __init__(self, directory: Path, latency: float = 0.0) -> None:
        port_file = directory / "engine_port"
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "bench/instant_engine.py"), str(port_file), str(latency)], preexec_fn=TIED
        )
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}/v1"

    def cpu(self) -> float:
        return _cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


class Stack:
    """`gym-grpc run` of the bench config, with its registry address and server processes."""

    def __init__(self, config: Path, *overrides: str) -> None:
        started = time.monotonic()
        self.run = GymRun.start(config, *overrides, preexec_fn=TIED)
        self.ready_seconds = time.monotonic() - started
        self.registry = self.run.registry
        self.servers = self.run.servers
        self.pids = sorted({pid for name in self.servers for pid in self.run.pids(name)})

    @property
    def process(self) -> subprocess.Popen:
        """The `gym-grpc run` process (the supervisor, which serves the registry)."""
        return self.run.process

    def cpu(self) -> float:
        return sum(_cpu_seconds(pid) for pid in self.pids)

    def memory(self, key: str = "VmRSS") -> list[float]:
        return [round(_memory_mb(pid, key), 1) for pid in self.pids]

    def stop(self) -> None:
        self.run.stop()


def server_names(stack: Stack) -> dict[int, str]:
    """The name of each server process of `gym-grpc run` by PID, from the registry's entries: a
    process that serves several servers (a `process:` group) is named after them all, joined
    by "+", and worker i of num_workers gets " #i"."""
    from gym_grpc.rpc.registry import Registry

    async def ask() -> dict[int, str]:
        registry = Registry(stack.registry)
        try:
            infos = await registry.list()
        finally:
            await registry.close()
        names: dict[int, list[str]] = {}
        workers: dict[int, tuple[int, int]] = {}
        for info in infos:
            for worker in info.replicas[0].workers:
                names.setdefault(worker.pid, []).append(info.name)
                workers[worker.pid] = (worker.index, info.workers)
        return {
            pid: "+".join(served) + (f" #{workers[pid][0]}" if workers[pid][1] > 1 else "")
            for pid, served in names.items()
        }

    return asyncio.run(ask())


@dataclass
class Measured:
    """A finished child process: its output, CPU time and peak memory."""

    returncode: int
    stdout: str
    stderr: str
    cpu_seconds: float
    peak_mb: float


def run_measured(args: list[str]) -> Measured:
    """Run a command to the end; wait4 gives its CPU time and peak RSS."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(args, stdout=out, stderr=err, preexec_fn=TIED)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:  # the benchmark is stopping (stop_on_termination, Ctrl-C): the command too
            process.kill()
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(
            process.returncode,
            out.read().decode(),
            err.read().decode(),
            usage.ru_utime + usage.ru_stime,
            usage.ru_maxrss / 1024,
        )


@dataclass
class Collection:
    rollouts: int
    failed: int
    seconds: float
    collector_cpu: float
    collector_peak_mb: float


def collect(
    stack: Stack, agent: str, tasks: Path, out: Path, window: int, *extra: str, keep: bool = False
) -> Collection:
    """Run `gym-grpc collect` as its own process; the wall time is the one it reports
    (from its start to the last rollout written, interpreter start-up not counted).
    `keep` resumes into an existing output instead of starting afresh."""
    if not keep:
        out.unlink(missing_ok=True)
    run = run_measured(collect_args(stack.registry, agent, tasks, out, window, *extra))
    match = re.search(r"(\d+) rollouts collected, (\d+) failed.* in ([\d.]+) s", run.stderr)
    if match is None:
        raise RuntimeError(f"collect failed:\n{run.stderr}")
    return Collection(int(match.group(1)), int(match.group(2)), float(match.group(3)), run.cpu_seconds, run.peak_mb)


def collect_args(registry: str, agent: str, tasks: Path, out: Path, window: int, *extra: str) -> list[str]:
    """The `gym-grpc collect` command line of a benchmark run (extra: more options)."""
    args = [_gym(), "collect", "--registry", registry, "--agent", agent, "--input", str(tasks), "--output", str(out)]
    return [*args, "--max-in-flight", str(window), "--no-progress", *extra]


def _tasks(directory: Path, name: str, rows: list[dict], count: int) -> Path:
    """A JSONL of `count` task rows, `rows` over and over (written once, a line at a time)."""
    path = directory / f"{name}_{count}.jsonl"
    if not path.exists():
        lines = [json.dumps(row) + "\n" for row in rows]
        with path.open("w") as f:
            for i in range(count):
                f.write(lines[i % len(lines)])
    return path


def bench_raw(calls: int, windows: list[int], payload: str = "rollout") -> list[dict]:
    """raw_echo.py: unary calls/s and CPU per call (client + server) at each window."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen(
            [sys.executable, str(REPO / "bench/raw_echo.py"), "server", str(port_file), payload], preexec_fn=TIED
        )
        try:
            while not port_file.exists() or not port_file.read_text():
                time.sleep(0.05)
            address = f"127.0.0.1:{port_file.read_text()}"
            for window in windows:
                cpu_before = _cpu_seconds(server.pid)
                client = run_measured(
                    [
                        sys.executable,
                        str(REPO / "bench/raw_echo.py"),
                        "client",
                        address,
                        str(calls),
                        str(window),
                        payload,
                    ]
                )
                run = json.loads(client.stdout)
                cpu = client.cpu_seconds + _cpu_seconds(server.pid) - cpu_before
                results.append(
                    {
                        "in_flight": window,
                        "calls": run["calls"],
                        "errors": run["errors"],
                        "calls_per_second": round(run["calls"] / run["seconds"]),
                        "cpu_ms_per_call": round(1000 * cpu / run["calls"], 3),
                    }
                )
        finally:
            server.kill()
            server.wait()
    return results


def bench_stack(tmp: Path, rollouts: int, windows: list[int], weather_rollouts: int) -> tuple[list[dict], dict, dict]:
    engine = InstantEngine(tmp)
    stack = Stack(_write_config(tmp, 0.0, engine.url))
    try:
        single = []
        tasks = _tasks(tmp, "single_turn", [SINGLE_TURN_ROW], rollouts)
        for window in windows:
            before = stack.cpu()
            run = collect(stack, "single_turn_agent", tasks, tmp / "out.jsonl", window)
            cpu = stack.cpu() - before + run.collector_cpu
            single.append(_row(run, cpu, in_flight=window))
        tasks = _tasks(tmp, "weather", WEATHER_ROWS, weather_rollouts)
        before = stack.cpu()
        run = collect(stack, "weather_agent", tasks, tmp / "out.jsonl", 1024)
        weather = _row(run, stack.cpu() - before + run.collector_cpu, in_flight=1024)
        before = stack.cpu() + engine.cpu()
        run = collect(stack, "http_weather_agent", tasks, tmp / "out.jsonl", 1024)
        cpu = stack.cpu() + engine.cpu() - before + run.collector_cpu
        weather_http = _row(run, cpu, in_flight=1024)
    finally:
        stack.stop()
        engine.stop()
    return single, weather, weather_http


def bench_durable(tmp: Path, rollouts: int, repeats: int) -> dict:
    """What durable rollouts cost when nothing fails, on two workloads: weather (a stateless
    environment) and the shopping cart (a session a rollout, whose tool calls wait until the
    collector has the turn that asked for them). Each collected with the runs durable (the default,
    their states kept in the output's states file), durable with `--no-states`, and with
    `--resume-attempts 0`, in turn (each round beginning with the next mode), `repeats` times each on
    one stack; CPU per rollout over every server process and the collector, and the ratios of the
    medians."""
    stack = Stack(_write_config(tmp, 0.0, cart=True))
    workloads = {
        "weather": ("weather_agent", WEATHER_ROWS, "two model calls, one tool call, no session"),
        "cart": ("cart_agent", CART_ROWS, "a session a rollout, several model and tool calls (shopping cart)"),
    }
    result: dict[str, dict] = {}
    try:
        for name, (agent, rows, what) in workloads.items():
            tasks = _tasks(tmp, name, rows, rollouts)
            modes = [
                ("durable", ()),
                ("durable_no_states", ("--no-states",)),
                ("not_durable", ("--resume-attempts", "0")),
            ]
            runs: dict[str, list[dict]] = {mode: [] for mode, _ in modes}
            for repeat in range(repeats):
                # Each round begins with another mode: a run's place in the round moved its CPU by a tenth.
                for mode, extra in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                    before = stack.cpu()
                    run = collect(stack, agent, tasks, tmp / "out.jsonl", 1024, *extra)
                    runs[mode].append(_row(run, stack.cpu() - before + run.collector_cpu, in_flight=1024))
            medians = {mode: statistics.median(row["cpu_ms_per_rollout"] for row in r) for mode, r in runs.items()}
            rates = {mode: statistics.median(row["rollouts_per_second"] for row in r) for mode, r in runs.items()}
            result[name] = {
                "workload": f"{name} ({what}), embedded policy, 1,024 in flight",
                "runs": runs,
                "median_cpu_ms_per_rollout": medians,
                "median_rollouts_per_second": rates,
                "cpu_ratio_durable_to_not": round(medians["durable"] / medians["not_durable"], 3),
                "rate_ratio_durable_to_not": round(rates["durable"] / rates["not_durable"], 3),
                "cpu_ratio_states_file_to_none": round(medians["durable"] / medians["durable_no_states"], 3),
                "rate_ratio_states_file_to_none": round(rates["durable"] / rates["durable_no_states"], 3),
            }
    finally:
        stack.stop()
    return result


def _row(run: Collection, cpu: float, **extra: int) -> dict:
    return {
        **extra,
        "rollouts": run.rollouts,
        "failed": run.failed,
        "seconds": round(run.seconds, 2),
        "rollouts_per_second": round(run.rollouts / run.seconds, 1),
        "cpu_ms_per_rollout": round(1000 * cpu / max(run.rollouts, 1), 3),
    }


def bench_latency(tmp: Path, in_flight: int, latency: float, peak_rate: float) -> dict:
    stack = Stack(_write_config(tmp, latency))
    try:
        tasks = _tasks(tmp, "single_turn", [SINGLE_TURN_ROW], in_flight)
        run = collect(stack, "single_turn_agent", tasks, tmp / "out.jsonl", in_flight, "--timeout", "600")
        peaks = dict(zip(stack.servers, stack.memory("VmHWM"), strict=False))
    finally:
        stack.stop()
    bound = in_flight / peak_rate + latency
    return {
        "in_flight": in_flight,
        "model_latency_seconds": latency,
        "rollouts": run.rollouts,
        "errors": run.failed,
        "seconds": round(run.seconds, 2),
        "target_seconds": round(1.5 * bound, 2),
        "peak_rss_mb": {**peaks, "collector": round(run.collector_peak_mb, 1)},
    }


class CpuHogs:
    """Busy processes that keep the machine loaded while a scenario runs."""

    def __init__(self, count: int) -> None:
        self.processes = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=TIED) for _ in range(count)
        ]

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def bench_http_engine(tmp: Path, in_flight: int, latencies: list[float], cpu_hogs: int) -> list[dict]:
    """`in_flight` weather rollouts at once through each HTTP model server to an engine
    that answers after each latency, while `cpu_hogs` busy processes load the machine."""
    results = []
    tasks = _tasks(tmp, "weather", WEATHER_ROWS, in_flight)
    for latency in latencies:
        engine = InstantEngine(tmp, latency)
        stack = Stack(_write_config(tmp, 0.0, engine.url))
        hogs = CpuHogs(cpu_hogs)
        try:
            for agent, server in (("http_weather_agent", "vllm"), ("responses_weather_agent", "openai")):
                load_before = os.getloadavg()[0]
                run = collect(stack, agent, tasks, tmp / "out.jsonl", in_flight, "--timeout", "900")
                results.append(
                    {
                        "model_server": server,
                        "in_flight": in_flight,
                        "engine_latency_seconds": latency,
                        "cpu_hogs": cpu_hogs,
                        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                        "rollouts": run.rollouts,
                        "errors": run.failed,
                        "seconds": round(run.seconds, 2),
                        # Two model calls per rollout, each at least `latency`: the floor is 2 x latency.
                        "floor_seconds": 2 * latency,
                    }
                )
        finally:
            hogs.stop()
            stack.stop()
            engine.stop()
    return results


def bench_collector(tmp: Path, input_rows: int, limit: int, checkpoint: int) -> dict:
    """Collect the first `checkpoint` rows of a large input, then resume the same
    command up to `limit`; the servers' memory is read, idle, after each."""
    tasks = _tasks(tmp, "million", [SINGLE_TURN_ROW], input_rows)
    stack = Stack(_write_config(tmp, 0.0))
    out = tmp / "million_out.jsonl"
    try:
        collect(stack, "single_turn_agent", tasks, out, 4096, "--limit", str(checkpoint))
        at_checkpoint = stack.memory()
        before = stack.cpu()
        run = collect(stack, "single_turn_agent", tasks, out, 4096, "--limit", str(limit), keep=True)
        cpu = stack.cpu() - before + run.collector_cpu
        at_end = stack.memory()
    finally:
        stack.stop()
    names = list(stack.servers)
    return {
        "input_rows": input_rows,
        "limit": limit,
        "resumed_from": checkpoint,
        **_row(run, cpu),
        "collector_peak_rss_mb": round(run.collector_peak_mb, 1),
        f"server_rss_mb_after_{checkpoint}": dict(zip(names, at_checkpoint, strict=False)),
        f"server_rss_mb_after_{limit}": dict(zip(names, at_end, strict=False)),
    }


def bench_collector_growth(tmp: Path, rollouts: int, step: int, window: int = 4096) -> dict:
    """One `gym-grpc collect` of `rollouts` single-turn rollouts, watched while it runs: at
    every `step` rollouts written, the collector's RSS (/proc/PID/status VmRSS), its CPU
    and the wall time of that step. Constant RSS after the first steps is the claim."""
    tasks = _tasks(tmp, "growth", [SINGLE_TURN_ROW], rollouts)
    stack = Stack(_write_config(tmp, 0.0))
    out = tmp / "growth_out.jsonl"
    out.unlink(missing_ok=True)
    out.touch()
    args = collect_args(stack.registry, "single_turn_agent", tasks, out, window)
    steps: list[dict] = []
    try:
        server_cpu = stack.cpu()
        with tempfile.TemporaryFile() as err, out.open("rb") as written:
            started = time.monotonic()
            process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
            rows = 0
            last = {"rollouts": 0, "seconds": 0.0, "cpu": 0.0, "server_cpu": server_cpu}
            usage = None
            while True:
                # wait4, not poll: it gives the finished collector's CPU time and peak RSS
                pid, status, exited = os.wait4(process.pid, os.WNOHANG)
                finished = pid != 0
                if finished:
                    process.returncode, usage = os.waitstatus_to_exitcode(status), exited
                rows += written.read().count(b"\n")
                while rows >= last["rollouts"] + step or (finished and rows > last["rollouts"]):
                    now = time.monotonic() - started
                    cpu = _cpu_seconds(process.pid) if not finished else last["cpu"]
                    rss = _memory_mb(process.pid, "VmRSS") if not finished else None
                    mark = min(rows, last["rollouts"] + step)
                    servers = stack.cpu()
                    n = mark - last["rollouts"]
                    steps.append(
                        {
                            "rollouts": mark,
                            "rss_mb": None if rss is None else round(rss, 1),
                            "seconds": round(now, 2),
                            "step_seconds": round(now - last["seconds"], 2),
                            "collector_cpu_ms_per_rollout": None
                            if finished
                            else round(1000 * (cpu - last["cpu"]) / n, 3),
                            "servers_cpu_ms_per_rollout": round(1000 * (servers - last["server_cpu"]) / n, 3),
                            "load_average_1m": round(os.getloadavg()[0], 1),
                        }
                    )
                    print(f"(d) {json.dumps(steps[-1])}", file=sys.stderr, flush=True)
                    last = {"rollouts": mark, "seconds": now, "cpu": cpu, "server_cpu": servers}
                if finished:
                    break
                time.sleep(0.1)
            ended = time.monotonic() - started
            err.seek(0)
            stderr = err.read().decode()
    finally:
        stack.stop()
    match = re.search(r"(\d+) rollouts collected, (\d+) failed.* in ([\d.]+) s", stderr)
    if process.returncode != 0 or match is None or usage is None:
        raise RuntimeError(f"collect failed ({process.returncode}):\n{stderr[-4000:]}")
    full = [s for s in steps if s["rss_mb"] is not None and s["rollouts"] % step == 0]
    measured = [s for s in full if s["collector_cpu_ms_per_rollout"] is not None]
    return {
        "rollouts": int(match.group(1)),
        "failed": int(match.group(2)),
        "window": window,
        "step": step,
        "collector_seconds": float(match.group(3)),
        # From the last row written to the collector's exit: the summary of the whole output.
        "seconds_after_last_row": round(ended - last["seconds"], 2),
        "collector_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
        "collector_peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "rss_mb_first_step": full[0]["rss_mb"] if full else None,
        "rss_mb_last_step": full[-1]["rss_mb"] if full else None,
        "rss_mb_max": max((s["rss_mb"] for s in full), default=None),
        "collector_cpu_ms_per_rollout": round(statistics.mean(s["collector_cpu_ms_per_rollout"] for s in measured), 3)
        if measured
        else None,
        "steps": steps,
    }


def table_growth(result: dict) -> str:
    lines = ["| rollouts | collector RSS MB | s for this step | collector CPU ms/rollout | servers CPU ms/rollout |"]
    lines.append("|---|---|---|---|---|")
    for s in result["steps"]:
        lines.append(
            f"| {s['rollouts']:,} | {s['rss_mb']} | {s['step_seconds']} | {s['collector_cpu_ms_per_rollout']} "
            f"| {s['servers_cpu_ms_per_rollout']} |"
        )
    return "\n".join(lines)


def _replicas_config(directory: Path, replicas: int) -> Path:
    """The weather workload with `replicas` replicas of each server (0: no Ray, one process each)."""
    agent = f"{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent"
    servers = {
        "policy_model": {"entrypoint": f"{REPO}/servers/models/local_policy/server.py:LocalPolicyModel"},
        "weather": {"entrypoint": f"{REPO}/servers/resources/weather/server.py:WeatherEnv"},
        "weather_agent": {
            "entrypoint": agent,
            "config": {"model_server": "policy_model", "resources_server": "weather"},
        },
    }
    config: dict[str, object] = {"registry": {"port": 0}, "servers": servers}
    if replicas:
        for spec in servers.values():
            spec.update(replicas=replicas, num_cpus=0.25)
    else:  # as under Ray, where each replica is one process of one server
        config["layout"] = "per_server"
    path = directory / f"replicas_{replicas}.yaml"
    path.write_text(json.dumps(config))
    return path


def _descendants(pids: list[int]) -> list[int]:
    """`pids` and every process they started."""
    return [*pids, *descendants(*pids)]


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += _cpu_seconds(pid)
        except (OSError, IndexError):
            pass  # gone
    return total


def _replicas(registry: str) -> dict[str, list[tuple[int, dict[str, int]]]]:
    """Every replica of every server: its pid and its finished calls by method (its own counters)."""
    import asyncio

    from gym_grpc.rpc import transport
    from gym_grpc.rpc.registry import Registry
    from gym_grpc.v1 import admin_service_pb2 as admin_pb
    from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc

    async def ask() -> dict[str, list[tuple[int, dict[str, int]]]]:
        client = Registry(registry)
        try:
            infos = await client.list()
        finally:
            await client.close()
        found: dict[str, list[tuple[int, dict[str, int]]]] = {}
        for info in infos:
            for address in info.addresses:
                async with transport.open_channel(address) as channel:
                    stub = admin_grpc.AdminServiceStub(channel)
                    pid = (await stub.GetServerInfo(admin_pb.GetServerInfoRequest(), timeout=10)).pid
                    counters = await stub.GetCounters(admin_pb.GetCountersRequest(), timeout=10)
                calls = {m.method: sum(m.calls_by_status.values()) for m in counters.methods}
                found.setdefault(info.name, []).append((pid, calls))
        return found

    return asyncio.run(ask())


def bench_replicas(tmp: Path, counts: list[int], rollouts: int, window: int, watchers: int, repeats: int) -> dict:
    from ray.cluster_utils import Cluster

    nodes, node_cpus = 3, 4
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": node_cpus, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=node_cpus)
    cluster.wait_for_nodes()
    ray_pids = [p.process.pid for node in cluster.list_all_nodes() for ps in node.all_processes.values() for p in ps]
    tasks = _tasks(tmp, "weather", WEATHER_ROWS, rollouts)
    runs = []
    try:
        for replicas in [0, *counts]:
            ray = ["--ray", cluster.address] if replicas else []
            stack = Stack(_replicas_config(tmp, replicas), *ray)
            try:
                servers = {name: [pid for pid, _ in found] for name, found in _replicas(stack.registry).items()}
                processes = _descendants([stack.run.process.pid, *(ray_pids if replicas else [])])
                tries = []
                for _ in range(repeats):
                    before = {name: _cpu_of(pids) for name, pids in servers.items()}
                    cpu_before = _cpu_of(processes)
                    run = collect(stack, "weather_agent", tasks, tmp / "replicas.jsonl", window)
                    cpu = _cpu_of(processes) - cpu_before + run.collector_cpu
                    by_server = {name: _cpu_of(pids) - before[name] for name, pids in servers.items()}
                    row = _row(run, cpu, replicas=replicas, in_flight=window)
                    done = max(run.rollouts, 1)
                    row["cpu_ms_per_rollout_by_process"] = {
                        **{name: round(1000 * seconds / done, 3) for name, seconds in by_server.items()},
                        "collector": round(1000 * run.collector_cpu / done, 3),
                        "runner and Ray": round(1000 * (cpu - sum(by_server.values()) - run.collector_cpu) / done, 3),
                    }
                    tries.append(row)
                # The run with the median rate stands for the configuration; every rate is kept.
                row = median_run(tries, key=lambda x: x["rollouts_per_second"])
                row["rollouts_per_second_runs"] = [x["rollouts_per_second"] for x in tries]
                row["failed"] = sum(x["failed"] for x in tries)
                row["ready_seconds"] = round(stack.ready_seconds, 2)
                calls = _replicas(stack.registry)  # over every run
                row["agent_runs_per_replica"] = [c.get("Run", 0) for _, c in calls["weather_agent"]]
                row["model_calls_per_replica"] = [c.get("CreateResponse", 0) for _, c in calls["policy_model"]]
                runs.append(row)
                print(f"  replicas {replicas or 'none (no Ray)'}: {row}", file=sys.stderr)
            finally:
                stack.stop()
    finally:
        cluster.shutdown()
    fanout = subprocess.run(
        [sys.executable, str(REPO / "bench/registry_fanout.py"), str(watchers)], capture_output=True, text=True
    )
    if fanout.returncode:
        raise RuntimeError(f"registry_fanout failed:\n{fanout.stderr}")
    return {"nodes": nodes, "node_cpus": node_cpus, "runs": runs, "registry_fanout": json.loads(fanout.stdout)}


def table_replicas(result: dict) -> str:
    lines = [
        "| replicas of each server | rollouts/s: median [each run] | CPU ms/rollout, all processes "
        "| of which model, weather, agent, collector, runner and Ray | ready in | Run per agent replica "
        "| CreateResponse per model replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        split = row["cpu_ms_per_rollout_by_process"]
        parts = [split[k] for k in ("policy_model", "weather", "weather_agent", "collector", "runner and Ray")]
        lines.append(
            f"| {row['replicas'] or 'none: one process each, no Ray'} | {row['rollouts_per_second']:,} "
            f"{row['rollouts_per_second_runs']} ({row['failed']} failed) | {row['cpu_ms_per_rollout']} "
            f"| {' / '.join(map(str, parts))} | {row['ready_seconds']} s | {row['agent_runs_per_replica']} "
            f"| {row['model_calls_per_replica']} |"
        )
    fan = result["registry_fanout"]
    lines.append(
        f"\nRegistry: one change reached {fan['watchers']:,} watchers in {fan['seconds_to_reach_all']} s, "
        f"{fan['cpu_ms_per_watcher']} ms CPU per watcher (registry and watchers in one process)."
    )
    return "\n".join(lines)


def bench_startup(repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        stack = Stack(REPO / "configs/quickstart.yaml", "registry.port=0")  # 50050 may be another run's
        seconds.append(stack.ready_seconds)
        stack.stop()
    return {
        "servers": 5,
        "seconds_median": round(statistics.median(seconds), 2),
        "seconds": [round(s, 2) for s in seconds],
    }


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    memory = int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": version("grpcio"),
        "protobuf": version("protobuf"),
    }


def table(results: dict) -> str:
    raw = max(results["raw_grpc"], key=lambda x: x["calls_per_second"])
    lines = [
        "| measurement | figure | CPU per unit |",
        "|---|---|---|",
        f"| (a) raw grpc.aio unary, empty handler, {raw['in_flight']} in flight | {raw['calls_per_second']:,} calls/s "
        f"| {raw['cpu_ms_per_call']} ms/call |",
    ]
    for row in results["single_turn"]:
        share = 100 * row["rollouts_per_second"] / raw["calls_per_second"]
        lines.append(
            f"| (b) single-turn rollouts, {row['in_flight']:,} in flight | {row['rollouts_per_second']:,} rollouts/s "
            f"({share:.0f}% of (a)), {row['failed']} failed | {row['cpu_ms_per_rollout']} ms/rollout |"
        )
    w = results["single_tool_call"]
    lines.append(
        f"| (b) single-tool-call rollouts (weather), 1,024 in flight | {w['rollouts_per_second']:,} rollouts/s, "
        f"{w['failed']} failed | {w['cpu_ms_per_rollout']} ms/rollout |"
    )
    v = results.get("single_tool_call_vllm")
    if v:
        lines.append(
            f"| (b) the same through the vllm model server and an instant local engine (HTTP, token ids) "
            f"| {v['rollouts_per_second']:,} rollouts/s, {v['failed']} failed | {v['cpu_ms_per_rollout']} ms/rollout |"
        )
    c = results["latency_16k"]
    lines.append(
        f"| (c) {c['in_flight']:,} in flight, model latency {c['model_latency_seconds']:g} s | {c['errors']} errors, "
        f"{c['seconds']} s (target < {c['target_seconds']} s), peak RSS MB {json.dumps(c['peak_rss_mb'])} | |"
    )
    d = results["collector_1m"]
    lines.append(
        f"| (d) collector on a {d['input_rows']:,}-row input, --limit {d['limit']:,}, resuming "
        f"after {d['resumed_from']:,} | peak RSS "
        f"{d['collector_peak_rss_mb']} MB, {d['rollouts_per_second']:,} rollouts/s "
        f"| {d['cpu_ms_per_rollout']} ms/rollout |"
    )
    during, after = (v for k, v in d.items() if k.startswith("server_rss_mb_after_"))
    lines.append(f"| (d) server RSS MB after {d['resumed_from']:,} rollouts | {json.dumps(during)} | |")
    lines.append(f"| (d) server RSS MB after {d['limit']:,} rollouts | {json.dumps(after)} | |")
    if "http_engine_16k" in results:
        lines.extend(table_http(results["http_engine_16k"]).splitlines()[2:])
    s = results["startup"]
    lines.append(
        f"| `gym-grpc run` quickstart, start to all healthy | {s['seconds_median']} s "
        f"(median of {len(s['seconds'])}) | |"
    )
    return "\n".join(lines)


def table_http(rows: list[dict]) -> str:
    lines = ["| measurement | figure | |", "|---|---|---|"]
    for e in rows:
        lines.append(
            f"| (e) {e['in_flight']:,} weather rollouts in flight through the {e['model_server']} model server, "
            f"engine latency {e['engine_latency_seconds']:g} s, {e['cpu_hogs']} CPU hogs (load "
            f"{e['load_average_1m'][1]}) | {e['errors']} errors, {e['seconds']} s (floor {e['floor_seconds']:g} s) | |"
        )
    return "\n".join(lines)


def _save(args: argparse.Namespace, results: dict, name: str) -> None:
    """Write the results with the command and the machine (a temp dir for --smoke)."""
    report = {
        "name": name,
        "command": " ".join(["python", "bench/run.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "results": results,
    }
    target = Path(tempfile.gettempdir()) if args.smoke else REPO / "bench" / "results"
    path = target / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {path}", file=sys.stderr)


def _bench_replicas(tmp: Path, sizes: dict) -> dict:
    return bench_replicas(
        tmp, sizes["replicas"], sizes["replica_rollouts"], 1024, sizes["watchers"], sizes["replica_repeats"]
    )


def _peer(args: argparse.Namespace) -> None:
    """gym-grpc beside NeMo Gym (bench/nemo_gym_peer.py): each workload at each window, every stack."""
    import nemo_gym_peer

    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(nemo_gym_peer.WORKLOADS)
    if unknown:
        sys.exit(f"unknown workloads {sorted(unknown)}: choose from {', '.join(nemo_gym_peer.WORKLOADS)}")
    windows = {w: list(nemo_gym_peer.WINDOWS[w]) for w in workloads}
    rows_for = nemo_gym_peer.rows_per_run
    if args.smoke:
        windows = {w: [4, 16] for w in workloads}
        rows_for = lambda stack, workload, window: 3 * window  # noqa: E731
    if args.peer_windows:
        windows = {w: [int(x) for x in args.peer_windows.split(",")] for w in workloads}
    repeats = (1 if args.smoke else 3) if args.peer_repeats is None else args.peer_repeats
    if repeats < 1:
        sys.exit(f"--peer-repeats must be at least 1, got {args.peer_repeats}")

    def save(result: dict) -> None:  # after each workload, so that a late failure keeps the rest
        _save(args, {"peer_nemo_gym": result}, f"{args.name}-peer-nemo-gym")

    with tempfile.TemporaryDirectory() as directory:
        result = nemo_gym_peer.bench_peer(Path(directory), windows, rows_for, workloads, repeats, save)
    print(nemo_gym_peer.table(result))
    failed = [
        (w["workload"], r["in_flight"], stack)
        for w in result["workloads"]
        for r in w["runs"]
        for stack in (*w["layouts"], "nemo_gym")
        if r[stack]["failed"]
    ]
    if failed:
        sys.exit(f"rollouts failed in {failed}")


def _admission(args: argparse.Namespace) -> None:
    import admission

    sizes = dict(rollouts=8, tokens=32, small=1, large=16, repeats=1) if args.smoke else {}
    sizes = {"rollouts": 128, "tokens": 128, "small": 2, "large": 48, "repeats": 3} | sizes
    if args.repeats:
        sizes["repeats"] = args.repeats
    with tempfile.TemporaryDirectory() as directory:
        result = admission.bench_admission(
            Path(directory),
            kv_cache_blocks=12 if args.smoke else 24,
            max_model_len=1024,
            engine_url=args.engine_url,
            engine_model=args.engine_model,
            **sizes,
        )
    _save(args, {"admission": result}, f"{args.name}-admission")
    print(admission.table(result))
    sys.exit(1 if any(m["failed"] for m in result["medians"].values()) else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, for CI")
    parser.add_argument("--name", default=platform.node() or "local", help="results file name")
    parser.add_argument("--cpu-hogs", type=int, default=4, help="busy processes loading the machine during (e)")
    parser.add_argument(
        "--only",
        choices=[
            "collector_1m",
            "http_engine_16k",
            "replicas",
            "peer",
            "cpu_split",
            "durable",
            "sandboxes",
            "images",
            "task_sampling",
            "admission",
        ],
        help="run only this scenario; results go to <name>-<scenario>.json",
    )
    parser.add_argument(
        "--peer", choices=["nemo-gym"], help="run only the side-by-side benchmark against this peer (as --only peer)"
    )
    parser.add_argument(
        "--workloads",
        default="weather,multi_turn,tokens,long_horizon",
        help="with --peer: which workloads, comma-separated (also: math)",
    )
    parser.add_argument("--peer-windows", help="with --peer: rollouts in flight, comma-separated (64,1024,4096)")
    parser.add_argument(
        "--peer-repeats",
        type=int,
        help="with --peer: runs of each stack at each window, the median reported (default 3, 1 with "
        "--smoke; NeMo Gym's math takes about ten minutes a run)",
    )
    parser.add_argument(
        "--collector-rollouts", type=int, help="rollouts of the collector growth run (d); default 1,000,000"
    )
    parser.add_argument("--collector-step", type=int, help="rollouts between two samples of that run; default 100,000")
    parser.add_argument("--repeats", type=int, help="with --only admission: rounds of the three windows (default 3)")
    parser.add_argument("--engine-url", help="with --only admission: a running vLLM's base URL (.../v1) to use")
    parser.add_argument("--engine-model", help="with --only admission and --engine-url: its served model name")
    args = parser.parse_args()
    stop_on_termination()
    if args.only == "admission":
        _admission(args)
        return
    if args.peer or args.only == "peer":
        _peer(args)
        return
    if args.smoke:
        sizes = dict(
            raw=2000,
            rollouts=500,
            windows=[64, 512],
            weather=200,
            latency_in_flight=512,
            input_rows=20_000,
            limit=2_000,
            growth_rollouts=4_000,
            growth_step=1_000,
            checkpoint=500,
            latency=0.5,
            http_in_flight=512,
            http_latencies=[0.5],
            replicas=[2],
            replica_rollouts=300,
            replica_repeats=1,
            watchers=200,
            split_rollouts=300,
            split_repeats=1,
        )
    else:
        sizes = dict(
            raw=100_000,
            rollouts=20_000,
            windows=[64, 1024, 16384],
            weather=10_000,
            latency_in_flight=16384,
            input_rows=1_000_000,
            limit=50_000,
            growth_rollouts=1_000_000,
            growth_step=100_000,
            checkpoint=10_000,
            latency=2.0,
            http_in_flight=16384,
            http_latencies=[2.0, 10.0],
            replicas=[1, 2, 4],
            replica_rollouts=5_000,
            replica_repeats=3,
            watchers=2_000,
            split_rollouts=10_000,
            split_repeats=3,
        )
    if args.collector_rollouts:
        sizes["growth_rollouts"] = args.collector_rollouts
    if args.collector_step:
        sizes["growth_step"] = args.collector_step
    results: dict = {}
    if args.only == "collector_1m":
        with tempfile.TemporaryDirectory() as directory:
            result = bench_collector_growth(Path(directory), sizes["growth_rollouts"], sizes["growth_step"])
        results["collector_1m_growth"] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(table_growth(result))
        sys.exit(1 if result["failed"] else 0)
    if args.only == "cpu_split":
        import cpu_split

        with tempfile.TemporaryDirectory() as directory:
            profiles = None if args.smoke else REPO / "bench" / "results" / f"{args.name}-cpu_split-profiles"
            result = cpu_split.bench_cpu_split(
                Path(directory), sizes["split_rollouts"], 1024, sizes["split_repeats"], sizes["raw"], profiles
            )
        results[args.only] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(cpu_split.table(result))
        sys.exit(1 if any(run["failed"] for run in result["runs"]) else 0)
    if args.only == "durable":
        with tempfile.TemporaryDirectory() as directory:
            result = bench_durable(Path(directory), sizes["weather"], sizes["split_repeats"])
        results[args.only] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(json.dumps({name: {k: v for k, v in w.items() if k != "runs"} for name, w in result.items()}, indent=2))
        failed = any(row["failed"] for w in result.values() for rows in w["runs"].values() for row in rows)
        sys.exit(1 if failed else 0)
    if args.only == "sandboxes":
        import sandboxes

        result = sandboxes.bench_sandboxes(args.smoke)
        results[args.only] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(json.dumps(result, indent=2))
        sys.exit(0 if result["terminal_scripted"]["mean_reward"] == 1.0 else 1)
    if args.only == "task_sampling":
        import task_sampling

        result = task_sampling.bench_task_sampling(args.smoke)
        results[args.only] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(task_sampling.table(result))
        sys.exit(0)
    if args.only == "images":
        import images

        result = images.bench_images()
        results[args.only] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(json.dumps(result, indent=2))
        sys.exit(0)
    if args.only == "replicas":
        with tempfile.TemporaryDirectory() as directory:
            result = _bench_replicas(Path(directory), sizes)
        results[args.only] = result
        _save(args, results, f"{args.name}-{args.only}")
        print(table_replicas(result))
        sys.exit(1 if any(row["failed"] for row in result["runs"]) else 0)
    if args.only:
        with tempfile.TemporaryDirectory() as directory:
            rows = bench_http_engine(Path(directory), sizes["http_in_flight"], sizes["http_latencies"], args.cpu_hogs)
        results[args.only] = rows
        _save(args, results, f"{args.name}-{args.only}")
        print(table_http(rows))
        sys.exit(1 if any(row["errors"] for row in rows) else 0)
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        print("(a) raw gRPC ...", file=sys.stderr)
        results["raw_grpc"] = bench_raw(sizes["raw"], [64, 256, 1024])
        print("(b) single-turn and single-tool-call rollouts ...", file=sys.stderr)
        results["single_turn"], results["single_tool_call"], results["single_tool_call_vllm"] = bench_stack(
            tmp, sizes["rollouts"], sizes["windows"], sizes["weather"]
        )
        peak = max(row["rollouts_per_second"] for row in results["single_turn"])
        print("(c) many in flight against a slow model ...", file=sys.stderr)
        results["latency_16k"] = bench_latency(tmp, sizes["latency_in_flight"], sizes["latency"], peak)
        print("(d) collector memory on a large input ...", file=sys.stderr)
        results["collector_1m"] = bench_collector(tmp, sizes["input_rows"], sizes["limit"], sizes["checkpoint"])
        results["collector_1m_growth"] = bench_collector_growth(tmp, sizes["growth_rollouts"], sizes["growth_step"])
        print("(e) many in flight through the HTTP model servers to a slow engine, machine loaded ...", file=sys.stderr)
        results["http_engine_16k"] = bench_http_engine(
            tmp, sizes["http_in_flight"], sizes["http_latencies"], args.cpu_hogs
        )
        print("(f) replicas on a Ray cluster of three nodes ...", file=sys.stderr)
        results["replicas"] = _bench_replicas(tmp, sizes)
        print("startup ...", file=sys.stderr)
        results["startup"] = bench_startup(3)
    _save(args, results, args.name)
    print(table(results))
    print(table_growth(results["collector_1m_growth"]))
    print(table_replicas(results["replicas"]))
    rows = [*results["single_turn"], results["single_tool_call"], results["single_tool_call_vllm"]]
    rows.append(results["collector_1m_growth"])
    rows += results["replicas"]["runs"]
    failures = [row for row in rows if row["failed"]] + [
        row for row in [results["latency_16k"], *results["http_engine_16k"]] if row["errors"]
    ]
    if failures:
        sys.exit(f"rollouts failed: {failures}")


if __name__ == "__main__":
    main()
