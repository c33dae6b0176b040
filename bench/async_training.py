"""GRPO through gym-grpc on the real CPU vLLM, asynchronous beside synchronous: does the reward rise, and
what does overlapping generation with the optimizer buy?

    python bench/async_training.py --steps 20 --name 2core-epyc-async_training   # bench/results/<name>.json, .png
    python bench/async_training.py --smoke                                         # 2 steps each; a temp dir

Needs CPU torch and transformers beside gym-grpc (as the trainer suite installs them):
    pip install -c tests/trainers/constraints.txt torch==2.13.0 transformers

One local vLLM (SmolLM2-135M-Instruct, started in dev mode by gym_grpc.engines.local_vllm, or
--engine-url), one `gym-grpc run` with the math environment behind the simple agent and vllm_model
(token in, token out), and a GRPO trainer of its own, here, on CPU torch: SmolLM2-135M-Instruct's
weights in float32, AdamW, the clipped importance-weighted policy gradient of PPO/GRPO with the
engine's log-probs as the behaviour policy (so a sample a step stale is still corrected for),
group-normalised advantages, no KL term. After every optimizer step the weights are written as a
bfloat16 checkpoint and loaded into the running engine through ModelService.UpdateWeights.

Why a loop of its own rather than TRL: TRL's GRPOTrainer asks for rollouts and then trains, one after
the other (its rollout_func is called inside the step), so it cannot show generation overlapping the
optimizer, which is the point here; this loop is ~150 lines and every number in the results comes
from it.

The task: "What is a + b?" for one-digit a and b, answered in at most 12 tokens, checked by the math
environment (math-verify). SmolLM2-135M-Instruct gets a fair share of them right but often rambles
past the answer or writes a wrong sum, so the reward has room to rise within 20 small steps, and the
groups are mostly mixed (a group with one reward for all carries no gradient).

Two runs, the same seed, tasks and budget:
  async  rollouts are produced all the time, paced by GymClient(max_lag=1): while the optimizer steps
         (in a thread) the engine keeps generating the next batch; each update is PAUSE_MODE_KEEP, so
         turns in flight continue under the new weights (their tokens' versions recorded).
  sync   a batch is generated, then trained on while the engine idles, then the weights are loaded
         (PAUSE_MODE_WAIT) and the next batch starts.
Per step: mean reward of the batch trained, the policy versions its tokens came from, samples trained,
stale samples (more than max_lag behind: masked), seconds waiting for the batch, in the optimizer, and
in the update. Per run: wall time, the engine's idle fraction (its /metrics sampled every 0.1 s:
no request running or waiting), and what the training loop's gym-grpc part costs (CpuMeter): the CPU
seconds of the `gym-grpc run` process tree and of gym-grpc's threads in the trainer (the event loop,
with GymClient and gym_grpc.training, and gRPC's own), as a share of the engine's CPU, of all the
run's CPU, and of its wall time. Each run's stack is new, and warmed up with one step's worth of
rollouts before it is measured: a stack's first rollouts cost it more than later ones, once per stack
(its cost is reported apart, stack_warm_up). Then, before the run, the stack and the trainer's
gym-grpc threads are watched for IDLE_SECONDS with nothing running (idle_rate): what gym-grpc spends
a second whatever it does (gRPC's C core wakes on timers in every process that has it). A run's
report gives that rate times its wall time (gym_grpc_idle_cpu_seconds), and its share of the engine's
CPU without it (gym_grpc_cpu_share_of_engine_beyond_idle): the part that grows with the rollouts,
where the idle part grows with a step's length, the optimizer's included.
A third mode, collect, is the baseline of that cost: the same steps' rollouts with no trainer.
`--repeats N` runs the modes N times in turn and reports each mode's median run with every run's
totals beside it: the engine's CPU, which the share is of, moves by a tenth from run to run.
`--group-workers` sets the stack's worker processes (auto: one per core).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pydantic

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_spec = importlib.util.spec_from_file_location("bench_real_engine", REPO / "bench" / "real_engine.py")
bench_real = sys.modules["bench_real_engine"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_real)

from gym_grpc import training  # noqa: E402
from gym_grpc.client import GymClient, RolloutResult  # noqa: E402
from gym_grpc.launch.config import GymConfig  # noqa: E402
from gym_grpc.rpc.registry import Registry  # noqa: E402
from gym_grpc.testing.processes import GymRun  # noqa: E402

AGENT, MODEL = "math_agent", "policy_model"


def tasks(seed: int) -> list[dict[str, Any]]:
    """Every "a + b" with one-digit a and b, in a seeded order."""
    rows = [
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "max_output_tokens": 12,
                "temperature": 1.0,
            },
            "expected_answer": str(a + b),
        }
        for a in range(1, 10)
        for b in range(1, 10)
    ]
    random.Random(seed).shuffle(rows)
    return rows


class Trainer:
    """GRPO on CPU torch over the policy's own weights; a checkpoint after every step."""

    def __init__(self, model_dir: Path, lr: float, clip: float, seed: int, out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        # One core of its own, as a trainer has its own devices: the engine's worker has core 0.
        torch.set_num_threads(1)
        if len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.clip = clip
        self.out = out
        self.model_dir = model_dir

    def step(self, samples: list[training.Sample]) -> dict[str, float]:
        """One optimizer step on the samples with an advantage (masked ones count for nothing)."""
        torch = self.torch
        used = [s for s in samples if s.loss_multiplier and s.advantage]
        if not used:
            return {"loss": 0.0, "tokens": 0}
        pad = max(len(s.prompt_ids) + len(s.response_ids) for s in used)
        ids = torch.zeros((len(used), pad), dtype=torch.long)
        mask = torch.zeros((len(used), pad))
        old = torch.zeros((len(used), pad))
        advantages = torch.tensor([s.advantage for s in used])
        for row, s in enumerate(used):
            sequence = s.prompt_ids + s.response_ids
            ids[row, : len(sequence)] = torch.tensor(sequence)
            start = len(s.prompt_ids)
            mask[row, start : len(sequence)] = torch.tensor(s.response_mask, dtype=torch.float32)
            old[row, start : len(sequence)] = torch.tensor(s.response_log_probs)
        logits = self.model(input_ids=ids).logits[:, :-1].float()
        new = torch.zeros_like(old)
        new[:, 1:] = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp((new - old) * mask)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        per_token = -torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None]) * mask
        loss = per_token.sum() / mask.sum()
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return {"loss": loss.item(), "tokens": int(mask.sum().item())}

    def save(self, version: int) -> Path:
        """The weights as a bfloat16 checkpoint (the engine's dtype) in a directory of their own."""
        path = self.out / f"step-{version}"
        state = {k: v.detach().to(self.torch.bfloat16) for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embeddings, as the model's own checkpoint has them
        self.model.save_pretrained(path, state_dict=state, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (self.model_dir / name).exists():
                shutil.copyfile(self.model_dir / name, path / name)
        return path


class EngineIdle:
    """The engine's idle fraction: its /metrics sampled every 0.1 s, idle when nothing runs or waits.

    Sampled from a thread of its own, not from the event loop, whose CPU CpuMeter counts as
    gym-grpc's: there, ten wake-ups a second with a thread hop each were most of the loop's CPU (0.23
    of its 0.9 s over a 4-step run, in a yappi profile of that thread)."""

    def __init__(self, engine_url: str) -> None:
        self.url = f"{engine_url.removesuffix('/v1')}/metrics"
        self.samples: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="engine-idle", daemon=True)

    def _idle(self) -> bool:
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            text = reply.read().decode()
        found = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return sum(map(float, found)) == 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._idle())
            self._stop.wait(0.1)

    def __enter__(self) -> EngineIdle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def fraction(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0


def _samples(
    groups: list[list[RolloutResult]], rows: list[dict[str, Any]], version: int, max_lag: int
) -> tuple[list[training.Sample], training.SampleStats]:
    rollouts = [
        training.TrainingRollout.from_result(result, AGENT, row_index, k)
        for group, row_index in zip(groups, rows, strict=True)
        for k, result in enumerate(group)
    ]
    samples, stats = training.build(rollouts, current_version=version, max_lag=max_lag)
    training.assign_advantages(samples)
    return samples, stats


def _record(step: int, groups: list[list[RolloutResult]], samples: list[training.Sample], stats: Any) -> dict[str, Any]:
    rewards = [r.reward for group in groups for r in group if r.ok]
    versions = sorted(
        {t.policy_version for group in groups for r in group if r.ok for t in r.turns if t.policy_version is not None}
    )
    spans = sum(
        1
        for group in groups
        for r in group
        if r.ok
        for item in r.rollout.response.output
        if item.WhichOneof("item") == "message" and item.message.policy_version_spans
    )
    return {
        "step": step,
        "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
        "rollouts": sum(len(g) for g in groups),
        "failed": sum(1 for g in groups for r in g if not r.ok),
        "versions_seen": versions,
        "turns_spanning_versions": spans,
        "samples_trained": sum(1 for s in samples if s.loss_multiplier and s.advantage),
        "stale_samples": stats.stale,
    }


# The names gRPC's C core gives its threads (as /proc shows them): its event engine's workers, the
# lifeguard that watches them, and the timer thread.
GRPC_CORE_THREADS = {"event_engine", "lifeguard", "grpc_global_tim"}


def _ran_ns(task: str) -> int:
    """Nanoseconds the thread at /proc/PID/task/TID has run (its schedstat); OSError once it has ended."""
    return int(Path(task, "schedstat").read_text().split()[0])


def _gym_grpc_threads() -> dict[int, tuple[bool, int]]:
    """This process's live threads that do gym-grpc's work, by id: whether it is gRPC's, and the
    nanoseconds it ran. The main thread (the event loop, with GymClient and gym_grpc.training), and
    gRPC's threads (its C core's, and grpc.aio's completion-queue poller, a Python thread running
    `_poll_wrapper`). Not the trainer's: the optimizer and the checkpoints run in worker threads, and
    torch has threads of its own."""
    main = threading.main_thread().native_id
    poller = {t.native_id for t in threading.enumerate() if "_poll_wrapper" in t.name}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            ran = _ran_ns(f"/proc/self/task/{tid}")
        except OSError:  # the thread ended
            continue
        if int(tid) == main or int(tid) in poller or name in GRPC_CORE_THREADS:
            found[int(tid)] = (int(tid) != main, ran)
    return found


def gym_grpc_threads_cpu() -> tuple[float, float]:
    """CPU seconds of this process's live threads that do gym-grpc's work (_gym_grpc_threads): the
    main thread's, then gRPC's. A pool thread that gRPC ended is missed (its CPU is the process's, no
    longer a thread's); the reserve the pool keeps does not end."""
    threads = _gym_grpc_threads().values()
    return sum(ran for grpc, ran in threads if not grpc) / 1e9, sum(ran for grpc, ran in threads if grpc) / 1e9


#: Seconds idle_rate watches a stack with nothing running.
IDLE_SECONDS = 10


def _tree_threads(root: int) -> dict[tuple[int, int], int]:
    """The nanoseconds each live thread of root's process tree ran, by (pid, thread id), from
    schedstat: an idle process's few milliseconds a second are under /proc/PID/stat's 10 ms ticks."""
    found = {}
    for pid in bench_real._tree(root):
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:  # ended
            continue
        for tid in threads:
            try:
                found[pid, int(tid)] = _ran_ns(f"/proc/{pid}/task/{tid}")
            except OSError:
                continue
    return found


def _ran_since(before: dict[Any, int], after: dict[Any, int]) -> float:
    """Seconds the threads of `after` ran since `before` (all of it for a thread new since): a thread
    that ended between the two is left out, rather than counted as running backwards."""
    return sum(ran - before.get(key, 0) for key, ran in after.items()) / 1e9


def _trainer_threads() -> dict[int, int]:
    return {tid: ran for tid, (_, ran) in _gym_grpc_threads().items()}


async def idle_rate(stack_pid: int, seconds: int = IDLE_SECONDS) -> dict[str, float]:
    """CPU milliseconds a second of gym-grpc with no rollout running: the `gym-grpc run` tree, and
    gym-grpc's threads in this (the trainer's) process; the median of `seconds` one-second windows of
    nothing, so that a one-off in one of them (a check pool's worker still starting, a collection of
    the garbage) does not stand for every second of the run. Watched from a thread of its own: the
    walk through /proc costs milliseconds, which the event loop's thread would count as gym-grpc's."""
    return await asyncio.to_thread(_idle_rate, stack_pid, seconds)


def _idle_rate(stack_pid: int, seconds: int) -> dict[str, float]:
    servers: list[float] = []
    trainer: list[float] = []
    for _ in range(seconds):
        stack, own = _tree_threads(stack_pid), _trainer_threads()
        began = time.monotonic()
        time.sleep(1.0)
        took = time.monotonic() - began
        servers.append(1000 * _ran_since(stack, _tree_threads(stack_pid)) / took)
        trainer.append(1000 * _ran_since(own, _trainer_threads()) / took)
    return {
        "servers_ms_per_second": round(statistics.median(servers), 3),
        "in_trainer_ms_per_second": round(statistics.median(trainer), 3),
    }


#: What the processes of the `gym-grpc run` tree do, for the split of its CPU (_server_role).
SERVER_ROLES = ("supervisor", "workers", "check_pools")


def _server_role(pid: int) -> str:
    """A process of the stack's tree by its command line: a server worker (`gym_grpc.server.worker`:
    the servers, grouped), a check pool's process (spawned by multiprocessing: an environment's
    checks, math-verify here), or the supervisor (`gym-grpc run` itself)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")  # whole: the name can come late
    except OSError:  # it ended
        return "supervisor"
    if "multiprocessing" in command:
        return "check_pools"
    return "workers" if "gym_grpc.server.worker" in command else "supervisor"


class CpuMeter:
    """The CPU seconds of gym-grpc's own work in a run, beside the engine's and the trainer's: the
    `gym-grpc run` process tree (supervisor and servers; split by SERVER_ROLES), gym-grpc's threads
    in the trainer process (gym_grpc_threads_cpu: gym_grpc_in_trainer, of which
    gym_grpc_in_trainer_grpc_threads are gRPC's), the trainer's whole process (with the optimizer's
    threads) and the engine's process tree; given the stack's idle_rate (`stack_idle`), the run's
    idle CPU and its share beyond it."""

    def __init__(self, stack_pid: int, engine_pid: int | None, stack_idle: dict[str, float] | None = None) -> None:
        self.stack_pid, self.engine_pid, self.stack_idle = stack_pid, engine_pid, stack_idle
        # The trainer's threads read last at the start and first at the end: the walk through /proc
        # (_read) runs on the event loop's thread, which is counted as gym-grpc's, and is the meter's.
        self.start = self._read() | self._in_trainer()

    @staticmethod
    def _in_trainer() -> dict[str, float]:
        loop, grpc_threads = gym_grpc_threads_cpu()
        return {"gym_grpc_in_trainer": loop + grpc_threads, "gym_grpc_in_trainer_grpc_threads": grpc_threads}

    def _read(self) -> dict[str, float]:
        tree = bench_real._tree_cpu
        servers = tree(self.stack_pid)
        by_role = dict.fromkeys(SERVER_ROLES, 0.0)
        for pid, cpu in servers.items():
            by_role[_server_role(pid)] += cpu
        return {
            "gym_grpc_servers": sum(servers.values()),
            **{f"gym_grpc_servers_{role}": cpu for role, cpu in by_role.items()},
            "trainer_process": time.process_time(),
            "engine": sum(tree(self.engine_pid).values()) if self.engine_pid else 0.0,
        }

    def report(self, wall: float, steps: int) -> dict[str, Any]:
        end = self._in_trainer() | self._read()
        used = {key: round(end[key] - self.start[key], 2) for key in end}
        gym = used["gym_grpc_servers"] + used["gym_grpc_in_trainer"]
        beyond: dict[str, Any] = {}
        if self.stack_idle is not None:
            idle = wall * sum(self.stack_idle.values()) / 1000
            beyond = {"idle": self.stack_idle, "gym_grpc_idle_cpu_seconds": round(idle, 3)}
            if self.engine_pid and used["engine"]:
                beyond["gym_grpc_cpu_share_of_engine_beyond_idle"] = round((gym - idle) / used["engine"], 4)
        return {
            **beyond,
            "cpu_seconds": used | {"gym_grpc_total": round(gym, 2)},
            "gym_grpc_cpu_seconds_per_step": round(gym / steps, 3),
            "gym_grpc_cpu_share_of_engine": round(gym / used["engine"], 4)
            if self.engine_pid and used["engine"]
            else None,
            "gym_grpc_cpu_share_of_all": round(
                gym / (used["trainer_process"] + used["gym_grpc_servers"] + used["engine"]), 4
            ),
            # gym-grpc's CPU time as a share of the run's wall time: at most its share of the steps'
            # critical path, were all of it on that path.
            "gym_grpc_cpu_share_of_wall": round(gym / wall, 4),
        }


async def run(
    mode: str,
    args: argparse.Namespace,
    stack: GymRun,
    engine_url: str,
    engine_pid: int | None,
    model_dir: Path,
    out: Path,
    stack_idle: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One training run, `mode` async or sync; its steps and totals (`stack_idle`: its idle_rate)."""
    registry = stack.registry
    rows = tasks(args.seed)
    trainer = Trainer(model_dir, args.lr, args.clip, args.seed, out)
    per_step = args.groups * args.group_size
    reg = Registry(registry)
    steps: list[dict[str, Any]] = []
    async with GymClient(
        AGENT,
        reg,
        policy_version=0,
        max_lag=args.max_lag if mode == "async" else None,
        rollouts_per_version=per_step if mode == "async" else None,
    ) as gym:
        await gym.update_weights(0, str(model_dir), MODEL, pause_mode="wait")  # every run starts from the model
        next_row = 0

        def take() -> int:
            nonlocal next_row
            next_row += 1
            return (next_row - 1) % len(rows)

        queue: asyncio.Queue[tuple[int, list[RolloutResult]]] = asyncio.Queue()
        in_flight: set[asyncio.Task[None]] = set()

        async def produce() -> None:
            """Async: groups all the time (pacing holds them back), as many in flight as one step takes."""
            slots = asyncio.Semaphore(args.groups)

            async def one() -> None:
                try:
                    row = take()
                    await queue.put((row, await gym.run_group(rows[row], args.group_size)))
                finally:
                    slots.release()

            while True:
                await slots.acquire()
                group = asyncio.ensure_future(one())
                in_flight.add(group)
                group.add_done_callback(in_flight.discard)

        meter = CpuMeter(stack.process.pid, engine_pid, stack_idle)
        producer = asyncio.ensure_future(produce()) if mode == "async" else None
        started = time.monotonic()
        with EngineIdle(engine_url) as idle:
            for step in range(args.steps):
                t0 = time.monotonic()
                if mode == "async":
                    batch = [await queue.get() for _ in range(args.groups)]
                else:
                    picked = [take() for _ in range(args.groups)]
                    groups = await asyncio.gather(*(gym.run_group(rows[i], args.group_size) for i in picked))
                    batch = list(zip(picked, groups, strict=True))
                waited = time.monotonic() - t0
                picked_rows = [row for row, _ in batch]
                groups = [group for _, group in batch]
                samples, stats = _samples(groups, picked_rows, step, args.max_lag)
                t1 = time.monotonic()
                loss = await asyncio.to_thread(trainer.step, samples)
                checkpoint = await asyncio.to_thread(trainer.save, step + 1)
                trained = time.monotonic() - t1
                t2 = time.monotonic()
                pause = "keep" if mode == "async" else "wait"
                await gym.update_weights(step + 1, str(checkpoint), MODEL, pause_mode=pause)
                updated = time.monotonic() - t2
                if step:  # the trainer's file work, off the loop thread that CpuMeter counts as gym-grpc's
                    await asyncio.to_thread(shutil.rmtree, out / f"step-{step}", ignore_errors=True)
                record = _record(step, groups, samples, stats)
                record.update(
                    loss=round(loss["loss"], 5),
                    tokens_trained=loss["tokens"],
                    generation_wait_seconds=round(waited, 2),
                    optimizer_seconds=round(trained, 2),
                    update_seconds=round(updated, 2),
                    step_seconds=round(time.monotonic() - t0, 2),
                )
                steps.append(record)
                print(json.dumps({"mode": mode, **record}), file=sys.stderr, flush=True)
        wall = time.monotonic() - started
        cost = meter.report(wall, len(steps))
        if producer is not None:  # the groups still running or held back end here, before the client
            for task in (producer, *in_flight):
                task.cancel()
            await asyncio.gather(producer, *in_flight, return_exceptions=True)
    await reg.close()
    return {
        "steps": steps,
        "wall_seconds": round(wall, 1),
        "seconds_per_step_median": round(statistics.median(s["step_seconds"] for s in steps), 2),
        "engine_idle_fraction": round(idle.fraction, 3),
        "first5_mean_reward": round(statistics.fmean(s["mean_reward"] for s in steps[:5]), 4),
        "last5_mean_reward": round(statistics.fmean(s["mean_reward"] for s in steps[-5:]), 4),
        **cost,
    }


async def _collect(
    stack: GymRun,
    engine_pid: int | None,
    batches: list[list[dict[str, Any]]],
    group_size: int,
    stack_idle: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Each batch's rows as groups of `group_size`, one batch after the other, with no trainer: the
    rollouts that succeeded, the wall time and CpuMeter's report (`stack_idle`: its idle_rate)."""
    reg = Registry(stack.registry)
    async with GymClient(AGENT, reg) as gym:
        meter = CpuMeter(stack.process.pid, engine_pid, stack_idle)
        started = time.monotonic()
        done = 0
        for batch in batches:
            groups = await asyncio.gather(*(gym.run_group(row, group_size) for row in batch))
            done += sum(1 for group in groups for result in group if result.ok)
        wall = time.monotonic() - started
        cost = meter.report(wall, len(batches))
    await reg.close()
    return {"rollouts": done, "wall_seconds": round(wall, 1), **cost}


async def collect_only(
    args: argparse.Namespace, stack: GymRun, engine_pid: int | None, stack_idle: dict[str, float] | None = None
) -> dict[str, Any]:
    """The baseline of the cost: a step's rollouts (the same tasks, groups and concurrency), `--steps`
    times, with no trainer, no optimizer and no weight update: what collection alone costs gym-grpc
    and the engine, measured by the same CpuMeter."""
    rows = tasks(args.seed)
    steps = [[rows[(step * args.groups + i) % len(rows)] for i in range(args.groups)] for step in range(args.steps)]
    return await _collect(stack, engine_pid, steps, args.group_size, stack_idle)


async def warm_up(args: argparse.Namespace, stack: GymRun, engine_pid: int | None) -> dict[str, Any]:
    """One step's worth of rollouts (the last tasks of the seeded order, never trained on) through a new
    stack before any run is measured: a server process's first rollouts cost it several times what
    later ones do (first connections, first renders and checks, code run for the first time), a cost
    paid once per stack and not per step. Reported apart from the runs (CpuMeter's figures)."""
    warm = await _collect(stack, engine_pid, [tasks(args.seed)[-args.groups :]], args.group_size)
    return {key: warm[key] for key in ("rollouts", "wall_seconds", "cpu_seconds")}


async def runs(
    args: argparse.Namespace, config: Path, engine_url: str, engine_pid: int | None, model_dir: Path, tmp: Path
) -> dict[str, Any]:
    """Each mode's runs, `--repeats` rounds of the modes in turn, on one event loop (gRPC's completion
    queue outlives a loop: a second asyncio.run in one process gets the first one's late events), each
    with a `gym-grpc run` of its own, whose model server serves no version yet; per mode, its median
    run (median_run)."""
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            # Started from the main thread and tied to it (bench_run.TIED follows the thread that started the
            # child): a benchmark killed, even by SIGKILL, takes its stack with it, as it takes its engine.
            # The loop waits the stack's few seconds of start-up.
            stack = GymRun.start(config, preexec_fn=bench_real.bench_run.TIED)
            try:
                warm = await warm_up(args, stack, engine_pid)
                stack_idle = await idle_rate(stack.process.pid, 1 if args.smoke else IDLE_SECONDS)
                if mode == "collect":
                    one = await collect_only(args, stack, engine_pid, stack_idle)
                else:
                    one = await run(mode, args, stack, engine_url, engine_pid, model_dir, tmp, stack_idle)
                one["stack_warm_up"] = warm
                results.setdefault(mode, []).append(one)
            finally:
                await asyncio.to_thread(stack.stop)
            # The run's garbage (a trainer's model and optimizer) is freed now, and what is left (torch's and
            # transformers' half a million objects) kept out of later collections, as gym-grpc's own
            # processes keep theirs: a full collection of them (0.2 CPU s on an idle machine) would fall
            # in a later run, on the loop thread CpuMeter counts as gym-grpc's. (The 0.4-0.5 CPU s that
            # one run in three still shows there is protobuf's malloc_trim: docs/training.md.)
            gc.collect()
            gc.freeze()
    return {mode: median_run(done) for mode, done in results.items()}


def median_run(done: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one mode's runs, the one of median gym-grpc share of the engine's CPU (the lower of the two middle
    ones for an even count), and beside it, when there are several, every run's totals (`runs`, in the
    order run): the engine's CPU, the share's denominator, moves from run to run on a shared machine."""
    if len(done) == 1:
        return done[0]
    median = bench_real.bench_run.median_run(done, lambda one: one["gym_grpc_cpu_share_of_engine"] or 0.0)
    median["runs"] = [{key: value for key, value in one.items() if key != "steps"} for one in done]
    return median


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, clock) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("async", "-o"), ("sync", "--s")):
        steps = report[mode]["steps"]
        reward.plot([s["step"] for s in steps], [s["mean_reward"] for s in steps], style, label=mode, markersize=3)
        elapsed = [sum(s["step_seconds"] for s in steps[: i + 1]) for i in range(len(steps))]
        clock.plot(elapsed, [s["mean_reward"] for s in steps], style, label=mode, markersize=3)
    reward.set(xlabel="optimizer step", ylabel="mean reward of the batch", title="GRPO on SmolLM2-135M, a + b")
    clock.set(xlabel="wall-clock seconds", ylabel="mean reward of the batch", title="the same, against time")
    for axes in (reward, clock):
        axes.grid(alpha=0.3)
        axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def group_workers(value: str) -> int | str:
    """--group-workers, as a configuration's `group_workers` takes it (GymConfig's rule and message)."""
    try:
        return GymConfig.model_validate({"servers": {}, "group_workers": value}).group_workers
    except pydantic.ValidationError as e:
        raise argparse.ArgumentTypeError("; ".join(error["msg"] for error in e.errors())) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=4, help="GRPO groups (tasks) per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--clip", type=float, default=0.2, help="PPO's clip of the importance ratio")
    parser.add_argument("--max-lag", type=int, default=1, help="async: versions a sample may be behind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default="async,sync",
        help="comma-separated, run in this order: async, sync, collect (the same rollouts without training)",
    )
    parser.add_argument("--engine-url", help="a running local vLLM in dev mode (its /v1 URL) instead of starting one")
    parser.add_argument("--engine-pid", type=int, help="with --engine-url: its pid, for the engine's CPU")
    parser.add_argument(
        "--group-workers",
        type=group_workers,
        default="auto",
        help="the stack's group_workers (its worker processes): auto (one per core) or a number",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of the modes; each mode's median run is reported"
    )
    parser.add_argument("--smoke", action="store_true", help="2 steps of 2 groups of 4; results in a temp dir")
    parser.add_argument("--name", default="async_training", help="results file name")
    args = parser.parse_args()
    bench_real.bench_run.stop_on_termination()
    unknown = set(args.modes.split(",")) - {"async", "sync", "collect"}
    if unknown:
        parser.error(f"--modes: no mode {', '.join(sorted(unknown))} (async, sync, collect)")
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} rounds; give 1 or more")
    if args.smoke:
        args.steps, args.groups, args.group_size = 2, 2, 4
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in os.getloadavg()]
    prepared = local_vllm.prepare()
    machine = bench_real.versions(prepared)
    engine = None
    engine_pid = args.engine_pid
    if args.engine_url:
        engine_url = args.engine_url
    else:
        print("starting the local vLLM ...", file=sys.stderr)
        engine = local_vllm.start(prepared, tied=True)
        engine_url, engine_pid = engine.base_url, engine.pid
    report = bench_real.report_head("bench/async_training.py", args, machine, load_start)
    report["settings"] = {
        "task": "What is a + b? (one-digit a, b; math environment, math-verify); max_output_tokens 12, temperature 1.0",
        "steps": args.steps,
        "groups_per_step": args.groups,
        "group_size": args.group_size,
        "lr": args.lr,
        "clip": args.clip,
        "max_lag": args.max_lag,
        "seed": args.seed,
        "group_workers": args.group_workers,
        "repeats": args.repeats,
    }
    try:
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            config = bench_real.write_stack(
                tmp,
                "async_training",
                ("math", "math/server.py:MathEnv"),
                {
                    MODEL: {
                        "base_url": engine_url,
                        "model": prepared.model_name,
                        "return_token_ids": True,
                        "tokenizer_dir": str(prepared.model_dir),
                        "chat_template": str(local_vllm.CHAT_TEMPLATE),
                        # the local engine's connections outlast a step (--engine-url: one local_vllm started)
                        "keepalive_seconds": local_vllm.CLIENT_KEEPALIVE_SECONDS,
                    }
                },
                {AGENT: (MODEL, 1)},
                group_workers=args.group_workers,
            )
            report.update(asyncio.run(runs(args, config, engine_url, engine_pid, prepared.model_dir, tmp)))
    finally:
        if engine is not None:
            local_vllm.stop(engine.pid)
    if "async" in report and "sync" in report:
        report["async_speedup"] = round(
            report["sync"]["seconds_per_step_median"] / report["async"]["seconds_per_step_median"], 2
        )
    report["steps"] = report.get("async", report.get("sync", {})).get("steps", [])
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    target = Path(tempfile.gettempdir()) if args.smoke else REPO / "bench" / "results"
    (target / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    if "async" in report and "sync" in report:
        plot(report, target / f"{args.name}.png")
    print(json.dumps({k: report[k] for k in ("async_speedup",) if k in report}))
    for mode in ("async", "sync", "collect"):
        if mode in report:
            totals = {k: v for k, v in report[mode].items() if k != "steps"}
            print(mode, json.dumps(totals))
    print(f"wrote {target / args.name}.json", file=sys.stderr)


if __name__ == "__main__":
    main()
