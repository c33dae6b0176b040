"""The task server: difficulty pools, dynamic sampling, a cap per task, over the real math environment.

The task set mixes tasks the embedded policy always solves (arithmetic at temperature 0), never
solves (the expected answer is wrong), and sometimes solves (temperature 1, where it slips).
"""

import asyncio
import io
import json
from collections import Counter

import pytest

from gym_grpc import errors
from gym_grpc.batch.task_batches import TaskBatchOptions, collect_batches
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.client.stubs import TaskClient
from gym_grpc.client.training import GymClient
from gym_grpc.data.jsonl import held
from gym_grpc.tasks import TaskServer
from gym_grpc.tasks.sampler import EASY, HARD, LEARNING, PoolRule, TaskSampler
from tests.support import REPO, eventually, grpcurl, gym, read_rows, run_status, start_run, static_registry

# --- the sampler alone -------------------------------------------------------------


def test_a_task_moves_to_the_pool_its_recent_pass_rate_says():
    sampler = TaskSampler([3], [1.0], PoolRule(history=4), seed=1)
    held = [sampler.draw() for _ in range(3)]
    assert {pool for _, _, pool in held} == {LEARNING}  # unseen tasks learn
    rewards = {0: [1.0] * 4, 1: [0.0] * 4, 2: [1.0, 0.0, 1.0, 0.0]}
    for dataset, index, _ in held:
        sampler.observe(dataset, index, rewards[index])
        sampler.release(dataset, index)
    assert [sampler.pool_of(0, i) for i in range(3)] == [EASY, HARD, LEARNING]
    assert sampler.pool_sizes() == {EASY: 1, LEARNING: 1, HARD: 1}
    # only the last `history` outcomes count: four passes make the hard task easy
    sampler.observe(0, 1, [1.0] * 4)
    assert sampler.record(0, 1).pass_rate == 1.0


def test_draws_follow_the_pool_proportions_and_a_pool_with_no_share_is_never_drawn():
    rule = PoolRule(proportions={EASY: 0.0, LEARNING: 1.0, HARD: 0.0})
    sampler = TaskSampler([4], [1.0], rule, seed=3)
    for _ in range(4):  # make 0 and 1 easy, 2 and 3 hard
        drawn = sampler.draw()
        assert drawn is not None
        sampler.observe(0, drawn[1], [1.0] if drawn[1] < 2 else [0.0])
        sampler.release(0, drawn[1])
    assert sampler.draw() is None  # only easy and hard tasks are left, and neither has a share


def test_without_pools_every_task_stays_drawable_whatever_its_outcomes():
    sampler = TaskSampler([2], [1.0], PoolRule(pools=False), seed=2)
    for reward in (1.0, 0.0):
        dataset, index, pool = sampler.draw()
        assert pool == LEARNING
        sampler.observe(dataset, index, [reward] * 4)
        sampler.release(dataset, index)
    assert sampler.pool_sizes() == {EASY: 0, LEARNING: 2, HARD: 0}
    assert {sampler.record(0, i).pass_rate for i in range(2)} == {0.0, 1.0}  # outcomes are still kept


def test_dataset_weights_share_the_draws():
    sampler = TaskSampler([100, 100], [3.0, 1.0], seed=7)
    counts: Counter[int] = Counter()
    for _ in range(200):
        dataset, index, _ = sampler.draw()
        counts[dataset] += 1
        sampler.release(dataset, index)
    assert 130 <= counts[0] <= 170, counts  # 150 expected; the seed makes it exact, the range says what it means


def test_a_held_task_is_not_drawn_again_and_a_task_at_its_cap_is_retired():
    sampler = TaskSampler([2], [1.0], max_groups=1, seed=0)
    first, second = sampler.draw(), sampler.draw()
    assert {first[1], second[1]} == {0, 1}
    assert sampler.draw() is None  # both held
    sampler.release(0, 0)
    sampler.release(0, 1)
    assert sampler.draw() is None and sampler.retired == 2


# --- the server, over real servers ---------------------------------------------------

ALWAYS = [(f"What is {a} + {b}? Put the final answer in \\boxed{{}}.", a + b) for a, b in [(17, 25), (40, 2), (8, 9)]]


def _rows() -> list[dict]:
    rows = []
    for question, answer in ALWAYS:  # temperature 0: the policy never slips
        rows.append({"responses_create_params": {"input": question, "temperature": 0}, "expected_answer": str(answer)})
    for question, answer in ALWAYS:  # a wrong expected answer: never solved
        rows.append({"responses_create_params": {"input": question, "temperature": 0}, "expected_answer": str(-answer)})
    for a, b in [(123, 456), (77, 88), (91, 19), (15, 16), (230, 4), (62, 71)]:  # temperature 1: it slips now and then
        question = f"Compute {a} * 3 + {b} - 7. Put the final answer in \\boxed{{}}."
        rows.append(
            {"responses_create_params": {"input": question, "temperature": 1.0}, "expected_answer": str(a * 3 + b - 7)}
        )
    return rows


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rows()))
    return path


async def _task_server(start, tasks_file, model_config=None, **config):
    """A task server over `tasks_file` in front of the math agent and the embedded policy
    (`model_config`: its settings): (the running model server, a registry that knows the task server)."""
    model = await start(LocalPolicyModel(model_config or {"error_rate": 0.3}))
    env = await start(MathEnv())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "math", "max_steps": 2},
            name="math_agent",
            registry=static_registry(model=model, math=env),
        )
    )
    settings = {"agent": "math_agent", "datasets": [{"name": "mixed", "jsonl_fpath": str(tasks_file)}], "seed": 5}
    server = TaskServer({**settings, **config}, name="tasks", registry=static_registry(math_agent=agent))
    return model, static_registry(tasks=await start(server))


async def test_dynamic_sampling_serves_only_groups_with_signal_and_counts_what_it_dropped(start, tasks_file):
    _, registry = await _task_server(start, tasks_file, group_size=8)
    client = TaskClient(registry, "tasks")
    groups, summary = [], None
    async for reply in client.next_batch(2):
        if reply.HasField("group"):
            groups.append(reply.group)
        else:
            summary = reply.summary
    assert summary is not None and summary.groups == len(groups) == 2
    for group in groups:
        rewards = [m.rollout.reward for m in group.members]
        assert len(rewards) == 8 and len(set(rewards)) == 2 and group.has_signal
        assert group.task_index >= 6  # only the tasks at temperature 1 can carry signal
    assert summary.groups_tried == 2 + summary.groups_without_signal + summary.groups_failed
    assert summary.rollouts == 8 * summary.groups_tried
    assert len({g.task_index for g in groups}) == 2  # distinct tasks in one batch
    await registry.close()


async def test_without_dynamic_sampling_groups_without_signal_are_served_too(start, tasks_file):
    _, registry = await _task_server(start, tasks_file, group_size=3, dynamic_sampling=False)
    async with GymClient("math_agent", registry) as gym:
        batch = await gym.next_batch("tasks", 12)
    assert batch.summary.groups == batch.summary.groups_tried == 12  # every task once
    by_task = {g.task_index: g for g in batch.groups}
    for index in range(3):
        assert [r.reward for r in by_task[index].results] == [1.0] * 3 and not by_task[index].has_signal
        assert [r.reward for r in by_task[index + 3].results] == [0.0] * 3
    row = by_task[0].rows()[0]
    assert row["reward"] == 1.0 and row["expected_answer"] == "42"
    await registry.close()


async def test_served_outcomes_move_tasks_between_pools_and_the_next_batch_skips_the_solved(start, tasks_file):
    _, registry = await _task_server(
        start, tasks_file, group_size=4, dynamic_sampling=False, pools={"easy": 0.0, "hard": 0.0, "learning": 1.0}
    )
    client = TaskClient(registry, "tasks")
    async for _ in client.next_batch(12):
        pass
    stats = await client.task_stats()
    pools = {t.task_index: t.pool for t in stats.tasks}
    assert [pools[i] for i in range(6)] == [EASY] * 3 + [HARD] * 3
    for task in (
        t for t in stats.tasks if t.task_index >= 6
    ):  # the tasks at temperature 1: where their own four outcomes put them
        rate = task.recent_pass_rate
        assert task.pool == (EASY if rate == 1.0 else HARD if rate == 0.0 else LEARNING)
    counts = Counter(pools.values())
    assert (stats.easy, stats.learning, stats.hard) == (counts[EASY], counts[LEARNING], counts[HARD])
    assert stats.total == 12 and stats.served.groups == 12
    # only the learning pool has a share now: the next batch draws the tasks still learning, never 0-5
    learning = [i for i in range(6, 12) if pools[i] == LEARNING]
    async with GymClient("math_agent", registry) as gym:
        batch = await gym.next_batch("tasks", 6)
    assert sorted(g.task_index for g in batch.groups) == learning
    if len(learning) < 6:
        assert "no task left to draw" in batch.summary.short_reason
    await registry.close()


async def test_a_batch_that_cannot_fill_ends_short_and_says_why(start, tasks_file):
    _, registry = await _task_server(start, tasks_file, group_size=2, max_draws_per_group=1)
    async with GymClient("math_agent", registry) as gym:
        batch = await gym.next_batch("tasks", 12)  # 12 draws at most, and 6 tasks never carry signal
    assert batch.summary.groups_tried == 12 and batch.summary.groups <= 6
    assert "12 groups tried" in batch.summary.short_reason
    assert len(batch.groups) == batch.summary.groups
    await registry.close()


async def test_the_cap_retires_a_task_and_an_exhausted_server_says_so(start, tasks_file):
    _, registry = await _task_server(start, tasks_file, group_size=2, dynamic_sampling=False, max_groups_per_task=1)
    client = TaskClient(registry, "tasks")
    async for _ in client.next_batch(12):
        pass
    assert (await client.task_stats()).retired == 12
    with pytest.raises(errors.FailedPrecondition) as caught:
        async for _ in client.next_batch(1):
            pass
    assert caught.value.reason == errors.Reason.TASKS_EXHAUSTED
    await registry.close()


async def test_a_request_outside_the_limits_names_its_field(start, tasks_file):
    _, registry = await _task_server(start, tasks_file)
    client = TaskClient(registry, "tasks")
    for request, field in (({"groups": 0}, "groups"), ({"groups": 1, "group_size": 1}, "group_size")):
        with pytest.raises(errors.InvalidArgument) as caught:
            async for _ in client.next_batch(**request):
                pass
        assert caught.value.field == field
    await registry.close()


def test_a_dataset_row_that_is_not_a_task_stops_the_server_naming_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"responses_create_params": {"input": "hi"}}\n\n{"responses_create_params": 3}\n')
    with pytest.raises(errors.ConfigError, match=r"bad\.jsonl:3: .*responses_create_params"):
        TaskServer({"agent": "a", "datasets": [{"name": "d", "jsonl_fpath": str(path)}]}, name="tasks")
    with pytest.raises(errors.ConfigError, match="dataset names must differ: d"):
        TaskServer({"agent": "a", "datasets": [{"name": "d", "jsonl_fpath": str(path)}] * 2}, name="tasks")
    with pytest.raises(errors.ConfigError, match="group_sise"):
        TaskServer({"datasets": [{"name": "d", "jsonl_fpath": str(path)}], "group_sise": 4}, name="tasks")


# --- through `gym-grpc run` and `collect` -------------------------------------------------


def test_collect_writes_the_groups_a_task_server_serves_and_grpcurl_reads_its_stats(tmp_path):
    configs = (
        REPO / "configs/local_policy.yaml",
        REPO / "servers/resources/math/config.yaml",
        REPO / "configs/math_tasks.yaml",
    )
    output = tmp_path / "groups.jsonl"
    # a policy that slips often enough that most groups carry signal, and room to draw many
    overrides = ("servers.policy_model.config.error_rate=0.3", "servers.math_tasks.config.max_draws_per_group=10")
    with start_run(*overrides, configs=configs) as run:
        done = gym(
            "collect", "--task-server", "math_tasks", "--batches", "2", "--groups", "3", "--num-repeats", "4",
            "--output", str(output), "--registry", run.registry,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "batch 2/2: 3 groups of" in done.stderr
        status, servers = run_status(run.registry)
        stats = json.loads(grpcurl(run.servers["math_tasks"], "gym.v1.TaskService/GetTaskStats"))
    assert status == 0 and servers["math_tasks"]["role"] == "tasks"
    rows = read_rows(output)
    assert len(rows) == 2 * 3 * 4  # the embedded policy fails no rollout
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["task_index"], []).append(row)
    assert sorted(groups) == list(range(6)) and all(len(g) == 4 for g in groups.values())
    for members in groups.values():
        assert len({m["reward"] for m in members}) == 2  # dynamic sampling: signal in every group
        served = {json.dumps(m["served_from"], sort_keys=True) for m in members}
        assert len(served) == 1
        assert members[0]["served_from"]["dataset"] in ("example", "train")
    assert int(stats["served"]["groups"]) == 6
    assert int(stats["served"]["rollouts"]) == 4 * stats["served"]["groups_tried"]
    # the samples of the output: one GRPO group per served group
    done = gym("samples", str(output), "--output", str(tmp_path / "samples.jsonl"))
    assert done.returncode == 0, done.stderr
    assert {s["uid"] for s in read_rows(tmp_path / "samples.jsonl")} == {f"math_agent/{i}" for i in groups}


def test_collect_refuses_file_options_with_a_task_server(tmp_path):
    done = gym("collect", "--task-server", "t", "--groups", "2", "--limit", "3", "--output", str(tmp_path / "o.jsonl"))
    assert done.returncode == 2 and "--limit: not with --task-server" in done.stderr
    done = gym("collect", "--task-server", "t", "--output", str(tmp_path / "o.jsonl"))
    assert done.returncode == 2 and "--task-server needs --groups" in done.stderr
    done = gym(
        "collect", "--groups", "2", "--input", str(REPO / "servers/resources/math/data/example.jsonl"), "--output", "o"
    )
    assert done.returncode == 2 and "--groups go with --task-server" in done.stderr
    done = gym("collect", "--output", str(tmp_path / "o.jsonl"))
    assert done.returncode == 2 and "give --input" in done.stderr


async def test_failed_rollouts_are_marked_members_and_a_group_without_two_finished_is_dropped(start, tasks_file):
    """A model server slower than the rollouts' deadline: every rollout fails, each batch ends short, no call
    fails, and the failures are no outcomes."""
    _, registry = await _task_server(
        start, tasks_file, {"latency_seconds": 30}, group_size=2, rollout_timeout_seconds=0.3
    )
    client = TaskClient(registry, "tasks")
    replies = [reply async for reply in client.next_batch(2)]  # no timeout asked: the server's 0.3 s
    assert [reply.WhichOneof("event") for reply in replies] == ["summary"]
    s = replies[0].summary
    assert s.groups_failed == s.groups_tried == 8 and s.rollouts_failed == s.rollouts == 16
    assert "8 groups tried" in s.short_reason
    stats = await client.task_stats()
    assert stats.learning == 12 and all(t.recent_rollouts == 0 for t in stats.tasks)
    await registry.close()


async def test_a_cancelled_batch_cancels_its_rollouts_and_gives_its_tasks_back(start, tasks_file):
    model, registry = await _task_server(start, tasks_file, {"latency_seconds": 30}, group_size=2)
    client = TaskClient(registry, "tasks")
    methods = model.app.counters.methods
    # cancelled once every rollout is in its first model call (a deadline could pass before some
    # had reached it, on a loaded machine)
    batch = asyncio.ensure_future(client.next_batch(3).__anext__())
    await eventually(
        lambda: "CreateResponse" in methods and methods["CreateResponse"].in_flight == 6,
        "three groups of two in their first model call",
    )
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    calls = methods["CreateResponse"]
    await eventually(lambda: calls.in_flight == 0, "the rollouts' model calls to be cancelled")
    assert dict(calls.by_status) == {"CANCELLED": 6}  # three groups of two, each cut in its first model call
    assert (await client.task_stats()).learning == 12  # the three held tasks are drawable again
    await registry.close()


async def test_a_task_batch_collect_into_an_output_another_run_is_writing_stops_before_it_asks_for_a_batch(tmp_path):
    """Two at once would number their groups alike (each one past the highest it found). No task
    server is needed: nothing is asked."""
    out = tmp_path / "groups.jsonl"
    options = TaskBatchOptions("tasks", out, batches=1, groups=2, group_size=2)
    with held(out):
        with pytest.raises(errors.OutputInUse, match=f"another run is writing {out}"):
            await collect_batches(static_registry(), options, io.StringIO())
    assert out.read_bytes() == b""
