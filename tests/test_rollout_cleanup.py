"""A rollout that ends for any reason closes its environment session: at its deadline during a tool
call or a verify, as `gym-grpc collect` sends it (over RunMany, where the run's deadline and the
collector's cancel of it both reach the agent), with real server and collector processes."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from tests.support import REPO, WEATHER, collect_args, gym, run_status, start_run

SLOW_ENV = textwrap.dedent(
    '''
    import asyncio

    from gym_grpc.resources import ResourcesServer, Session, Verification, tool


    class SlowEnv(ResourcesServer):
        """Holds a session per rollout; its tool and its verify take as long as the task says."""

        @tool
        async def get_weather(self, city: str, session: Session) -> str:
            """Get the current weather in a city."""
            await asyncio.sleep(float(session.data.get("tool_seconds", 0)))
            return '{"city": "%s", "temperature_c": 21}' % city

        async def verify(self, session: Session, response) -> Verification:
            await asyncio.sleep(float(session.data.get("verify_seconds", 0)))
            return Verification(reward=1.0)
    '''
)


def _config(directory) -> object:
    (directory / "slow_env.py").write_text(SLOW_ENV)
    config = directory / "slow.yaml"
    config.write_text(
        f"include: [{REPO / 'configs' / 'local_policy.yaml'}]\n"
        "servers:\n"
        "  slow:\n"
        f"    entrypoint: {directory / 'slow_env.py'}:SlowEnv\n"
        "  slow_agent:\n"
        f"    entrypoint: {REPO / 'servers/agents/simple_agent/agent.py'}:SimpleAgent\n"
        "    config: {model_server: policy_model, resources_server: slow, max_steps: 4}\n"
    )
    return config


def _sessions_open(registry: str) -> int:
    code, rows = run_status(registry)
    assert code == 0, rows
    return rows["slow"]["sessions_open"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["tool_seconds", "verify_seconds"])
def test_a_rollout_past_its_deadline_closes_its_session(tmp_path, stage):
    """20 rollouts whose tool call (or verify) outlasts `--timeout 2`: they fail with DEADLINE_EXCEEDED,
    and each closes its session within the agent's close time-out, not at the environment's idle one."""
    tasks = tmp_path / "tasks.jsonl"
    weather = [json.loads(line) for line in WEATHER.read_text().splitlines()]
    with tasks.open("w") as f:
        for i in range(20):
            f.write(json.dumps({**weather[i % len(weather)], stage: 4}) + "\n")
    with start_run(configs=(_config(tmp_path),)) as run:
        done = gym(*collect_args(run.registry, "slow_agent", tasks, tmp_path / "out.jsonl"), "--timeout", "2")
        assert done.returncode == 1, done.stderr
        failures = [json.loads(line) for line in (tmp_path / "out.failures.jsonl").read_text().splitlines()]
        # (the embedded policy sometimes answers without the tool: those rollouts end in time)
        assert len(failures) >= 10 and {f["error"]["code"] for f in failures} == {"DEADLINE_EXCEEDED"}
        # The closes run past the rollouts' deadlines (the agent gives each 5 s); the environment's
        # idle time-out (30 min) would close them much later.
        deadline = time.monotonic() + 60
        while (left := _sessions_open(run.registry)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == 0, f"{left} of 20 sessions left open"
        code, rows = run_status(run.registry)
        assert rows["slow_agent"]["sessions_not_closed"] == 0
