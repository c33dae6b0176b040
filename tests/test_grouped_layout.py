"""The default layout of `gym-grpc run`: servers linked by references run as one process group;
`layout: per_server` (or an explicit `process:`, or Ray) keeps a process per server."""

from __future__ import annotations

import logging

import pytest
import yaml
from pydantic import ValidationError

from gym_grpc.errors import ConfigError
from gym_grpc.launch import config as config_module
from gym_grpc.launch.config import GymConfig, load_config
from gym_grpc.launch.runner import Runner, StartupError
from tests.support import MATH, QUICKSTART, WEATHER, collect_args, gym, read_rows, run_status, start_run


def _config(servers: dict, **top) -> GymConfig:
    specs = {name: {"entrypoint": f"x.py:{name.title()}", **spec} for name, spec in servers.items()}
    return GymConfig.model_validate({"servers": specs, **top})


def _processes(config: GymConfig) -> dict[str, str | None]:
    return {name: spec.process for name, spec in config.servers.items()}


#: Two rollouts (an agent calling a model and an environment, a judge calling its model through a
#: nested list) and a server nobody names.
LINKED = {
    "policy": {},
    "env": {"config": {"judge": {"servers": [{"name": "judge"}]}}},
    "judge": {"config": {"model_server": "judge_model"}},
    "judge_model": {},
    "agent": {"config": {"model_server": "policy", "resources_server": "env"}},
    "other_model": {},
    "other_agent": {"config": {"tools": {"model": "other_model"}}},
    "lonely": {"config": {"name": "nobody", "n": 3}},
}


def test_servers_linked_through_nested_references_run_as_one_group_named_after_their_caller():
    config = _config(LINKED)
    assert config.layout == "grouped"
    assert _processes(config) == {
        "policy": "agent",
        "env": "agent",
        "judge": "agent",
        "judge_model": "agent",
        "agent": "agent",
        "other_model": "other_agent",
        "other_agent": "other_agent",
        "lonely": None,
    }
    assert config.layout_notes == []


def test_a_component_with_an_explicit_process_is_left_as_written():
    servers = {**LINKED, "judge_model": {"process": "judging"}, "judge": {**LINKED["judge"], "process": "judging"}}
    config = _config(servers)
    assert _processes(config) == {
        "policy": None,
        "env": None,
        "judge": "judging",
        "judge_model": "judging",
        "agent": None,
        "other_model": "other_agent",
        "other_agent": "other_agent",
        "lonely": None,
    }


def _workers(config: GymConfig) -> dict[str, int]:
    return {name: spec.num_workers for name, spec in config.servers.items()}


def test_a_group_runs_a_worker_per_core_unless_group_workers_or_its_servers_say_otherwise(monkeypatch):
    monkeypatch.setattr(config_module, "cores", lambda: 24)
    grouped = {"policy": 8, "env": 8, "judge": 8, "judge_model": 8, "agent": 8, "other_model": 8, "other_agent": 8}
    assert _workers(_config(LINKED)) == {**grouped, "lonely": 1}  # a core each, at most 8; a server alone: 1
    monkeypatch.setattr(config_module, "cores", lambda: 2)
    assert _workers(_config(LINKED))["agent"] == 2
    assert set(_workers(_config(LINKED, group_workers=3)).values()) == {1, 3}
    # Servers that set num_workers keep it (they agree: else they are not grouped at all).
    said = {**LINKED, "other_model": {"num_workers": 4}, "other_agent": {**LINKED["other_agent"], "num_workers": 4}}
    assert _workers(_config(said)) == {**dict.fromkeys(grouped, 2), "other_model": 4, "other_agent": 4, "lonely": 1}
    assert set(_workers(_config(LINKED, layout="per_server")).values()) == {1}  # nothing grouped, nothing changed
    for wrong in (0, -1, "some"):
        with pytest.raises(ValidationError, match="group_workers"):
            _config(LINKED, group_workers=wrong)


def test_a_task_server_runs_in_a_process_of_its_own_and_the_rollouts_it_links_group_apart(monkeypatch):
    """A task server's draws and pools are one (TaskServer.one_process): in a group of two workers,
    each worker would serve the batches that reach it from pools of its own. It runs alone, and the
    two rollouts it names, linked only through it, form a group each."""
    monkeypatch.setattr(config_module, "cores", lambda: 2)
    servers = {
        "tasks": {"entrypoint": "gym_grpc.tasks:TaskServer", "config": {"agent": "agent", "rows": ["other_agent"]}},
        "policy": {},
        "env": {},
        "agent": {"config": {"model_server": "policy", "resources_server": "env"}},
        "other_model": {},
        "other_agent": {"config": {"model_server": "other_model"}},
    }
    config = _config(servers)
    assert _processes(config) == {
        "tasks": None, **dict.fromkeys(("policy", "env", "agent"), "agent"),
        **dict.fromkeys(("other_model", "other_agent"), "other_agent"),
    }  # fmt: skip
    assert _workers(config) == {"tasks": 1, **dict.fromkeys(list(servers)[1:], 2)}


async def test_gym_grpc_run_refuses_a_task_server_in_several_workers_naming_the_setting():
    config = GymConfig.model_validate({
        "registry": {"port": 0},
        "servers": {"tasks": {
            "entrypoint": "gym_grpc.tasks:TaskServer",
            "num_workers": 2,
            "config": {"agent": "a", "datasets": [{"name": "d", "jsonl_fpath": str(MATH)}]},
        }},
    })  # fmt: skip
    refused = r"'tasks' could not start: num_workers is 2, but TaskServer runs in one process"
    with pytest.raises(StartupError, match=refused):
        await Runner(config, startup_timeout=60).start()


def test_group_workers_is_a_setting_and_a_typo_of_it_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("servers:\n  m: {entrypoint: 'x.py:M'}\n  a: {entrypoint: 'x.py:A', config: {model_server: m}}\n")
    assert _workers(load_config([path], ["group_workers=1"])) == {"m": 1, "a": 1}
    with pytest.raises(ConfigError, match="'group_worker' is no setting"):
        load_config([path], ["group_worker=1"])


def test_a_derived_name_that_an_explicit_process_has_gets_a_suffix():
    servers = {"agent": {"config": {"model_server": "m"}}, "m": {}, "solo": {"process": "agent"}}
    assert _processes(_config(servers)) == {"agent": "agent.2", "m": "agent.2", "solo": "agent"}


@pytest.mark.parametrize("key, value", [("num_workers", 2), ("restart", True)])
def test_a_component_whose_servers_disagree_on_workers_or_restart_runs_a_process_per_server(key, value):
    config = _config({**LINKED, "judge_model": {key: value}})
    processes = _processes(config)
    assert [processes[n] for n in ("policy", "env", "judge", "judge_model", "agent")] == [None] * 5
    assert processes["other_agent"] == processes["other_model"] == "other_agent"
    (note,) = config.layout_notes
    assert "servers policy, env, judge, judge_model, agent" in note and f"disagree on {key}" in note
    assert f"judge_model {value}" in note


async def test_gym_grpc_run_logs_why_linked_servers_run_apart_before_it_starts_them(caplog):
    config = _config({"m": {}, "a": {"config": {"model_server": "m"}, "restart": True}}, registry={"port": 0})
    with caplog.at_level(logging.WARNING, logger="gym_grpc.launch.runner"), pytest.raises(StartupError):
        await Runner(config, startup_timeout=60).start()  # x.py does not exist: the servers cannot start
    assert caplog.records[0].getMessage() == config.layout_notes[0]
    assert "servers m, a call each other but run in processes of their own" in config.layout_notes[0]


def test_per_server_layout_and_ray_group_nothing(tmp_path):
    assert set(_processes(_config(LINKED, layout="per_server")).values()) == {None}
    assert set(_processes(_config(LINKED, ray={"address": "local"})).values()) == {None}
    path = tmp_path / "c.yaml"
    path.write_text("servers:\n  m: {entrypoint: 'x.py:M'}\n  a: {entrypoint: 'x.py:A', config: {model_server: m}}\n")
    assert _processes(load_config([path])) == {"m": "a", "a": "a"}
    assert _processes(load_config([path], ["layout=per_server"])) == {"m": None, "a": None}
    assert _processes(load_config([path], ["ray.address=local"])) == {"m": None, "a": None}


def test_dump_config_shows_the_layout_and_each_servers_process():
    grouped = yaml.safe_load(gym("dump-config", str(QUICKSTART)).stdout)
    assert grouped["layout"] == "grouped"
    assert {name: spec["process"] for name, spec in grouped["servers"].items()} == dict.fromkeys(
        ("policy_model", "weather", "weather_agent", "math", "math_agent"), "weather_agent"
    )
    apart = yaml.safe_load(gym("dump-config", str(QUICKSTART), "layout=per_server").stdout)
    assert apart["layout"] == "per_server"
    assert {spec["process"] for spec in apart["servers"].values()} == {None}


WORKERS = GymConfig().workers_per_group  # a worker per core, up to 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, processes",
    [((), WORKERS), (("group_workers=1",), 1), (("layout=per_server",), 5)],
    ids=["a worker per core", "one process", "per server"],
)
def test_gym_grpc_run_serves_the_quickstart_from_one_group_unless_per_server(tmp_path, overrides, processes):
    run = start_run(*overrides)
    try:
        assert "5 servers healthy" in run.log() and f"({processes} process{'es' if processes > 1 else ''})" in run.log()
        code, rows = run_status(run.registry)
        assert code == 0 and all(row["health"] == "serving" for row in rows.values())
        rollout = [set(run.pids(name)) for name in ("policy_model", "weather", "weather_agent")]
        if "layout=per_server" in overrides:
            assert all(len(pids) == 1 for pids in rollout) and len(set.union(*rollout)) == 3
        else:  # every worker of the group serves all three
            assert rollout[0] == rollout[1] == rollout[2] and len(rollout[0]) == processes
        out = tmp_path / "out.jsonl"
        done = gym(*collect_args(run.registry, "weather_agent", WEATHER, out), "--no-progress")
        assert done.returncode == 0, done.stderr
        assert len(read_rows(out)) == len(WEATHER.read_text().splitlines())
    finally:
        run.stop()


@pytest.mark.slow
def test_the_servers_of_a_group_share_its_profile_and_its_log(tmp_path):
    """yappi is one per process: every server of the group shows the process's profile (the math
    environment's too, though the group's first server is the model), and one log is written.
    In one process, which `gym-grpc profile` (one worker's live profile) then shows whole."""
    profiles = tmp_path / "profiles"
    run = start_run("group_workers=1", "profiling_enabled=true", f"profiling_results_dirpath={profiles}")
    try:
        done = gym(*collect_args(run.registry, "math_agent", MATH, tmp_path / "out.jsonl"), "--no-progress")
        assert done.returncode == 0, done.stderr
        live = gym("profile", "math", "--registry", run.registry, "--limit", "500")
        assert live.returncode == 0, live.stderr
        assert "MathEnv.verify" in live.stdout and "SimpleAgent" in live.stdout
    finally:
        assert run.stop() == 0
    assert sorted(p.name for p in profiles.iterdir()) == ["weather_agent.log"]
