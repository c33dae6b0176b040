"""Engine-aware admission: the control rule on given loads, vLLM's real /metrics text parsed, a model
server reading its engine's /metrics over loopback into GetCounters, `status` and its Prometheus
endpoint, and `collect --admission engine` sizing its window from it."""

import asyncio
import io
import json
import socket
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.cli.app import main as cli
from gym_grpc.client import admission_metrics, training
from gym_grpc.client.admission import Admission, Controller, Decision, Limits, Load, limiting_rollouts
from gym_grpc.client.training import GymClient
from gym_grpc.engines import load as engine_load
from gym_grpc.launch import observe
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import serve
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from tests.support import Calculator, static_registry

#: GET /metrics of the local CPU vLLM (0.32.0) while 30 requests ran on a 32-block KV cache.
VLLM_METRICS = (Path(__file__).parent / "data" / "vllm-0.32.0-metrics.txt").read_text()


def metrics_text(kv: float, running: int, waiting: int, preemptions: int, engine: str = "0") -> str:
    """The four series a model server reads, as vLLM 0.32 writes them."""
    labels = f'engine="{engine}",model_name="m"'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}.0\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}.0\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
        "# TYPE vllm:num_preemptions counter\n"
        f"vllm:num_preemptions_total{{{labels}}} {preemptions}.0\n"
    )


def load(kv: float = 0.0, running: int = 0, waiting: int = 0, preemptions: int = 0) -> Load:
    return Load(kv_cache_usage=kv, requests_running=running, requests_waiting=waiting, preemptions_total=preemptions)


# The control rule, on given loads.


def test_from_an_empty_kv_cache_the_window_doubles_while_full_up_to_the_ceiling():
    controller = Controller(Limits(floor=1, ceiling=12))
    windows = [controller.decide(load(), in_flight=controller.window).window for _ in range(6)]
    assert windows == [2, 4, 8, 12, 12, 12]


def test_growth_heads_halfway_to_the_kv_target_in_proportion():
    controller = Controller(Limits(floor=10, ceiling=100, kv_target=0.75))
    decision = controller.decide(load(kv=0.25, running=10), in_flight=10)  # at 10: 25%; 30 would be at 75%
    assert (decision.action, decision.window) == ("grow", 20)


def test_a_window_that_is_not_full_does_not_grow():
    controller = Controller(Limits(floor=4))
    decision = controller.decide(load(kv=0.1, running=2), in_flight=2)
    assert (decision.action, decision.window, decision.reason) == ("hold", 4, "the window is not full")


def test_between_target_and_high_mark_the_window_holds():
    controller = Controller(Limits(floor=8, kv_target=0.7, kv_high=0.9))
    assert controller.decide(load(kv=0.8, running=8), in_flight=8).action == "hold"
    assert controller.window == 8


def test_preemptions_since_the_last_read_cut_the_window_but_the_first_read_is_a_baseline():
    controller = Controller(Limits(floor=1, ceiling=64))
    controller.window = 40
    first = controller.decide(load(kv=0.8, running=40, preemptions=500), in_flight=40)
    assert (first.preempted, first.action) == (0, "hold")  # 500 before this client looked: not its doing
    cut = controller.decide(load(kv=0.8, running=40, preemptions=503), in_flight=40)
    assert (cut.action, cut.window, cut.preempted) == ("cut", 30, 3)
    assert "3 preemptions" in cut.reason


def test_after_a_cut_the_next_waits_until_the_rollouts_in_flight_are_down_to_the_window():
    controller = Controller(Limits(floor=1, ceiling=64, kv_high=0.9))
    controller.window = 40
    assert controller.decide(load(kv=0.95, running=40), in_flight=40).window == 30
    still = controller.decide(load(kv=0.95, running=38), in_flight=38)  # the cut has not taken effect yet
    assert (still.action, still.window) == ("hold", 30) and "not taken effect" in still.reason
    assert controller.decide(load(kv=0.95, running=30), in_flight=30).window == 22  # now it has


def test_after_an_overflow_the_window_grows_by_one_a_round_trip():
    controller = Controller(Limits(floor=1, ceiling=64, kv_high=0.9))
    controller.window = 20
    assert controller.decide(load(kv=0.95, running=20), in_flight=20, ended=100).window == 15  # overflowed
    early = controller.decide(load(kv=0.3, running=15), in_flight=15, ended=114)  # 14 ended since the cut
    assert (early.action, early.window) == ("hold", 15) and early.reason.startswith("probing")
    assert controller.decide(load(kv=0.3, running=15), in_flight=15, ended=115).window == 16  # +1, not a jump
    assert controller.decide(load(kv=0.3, running=16), in_flight=16, ended=130).window == 16  # 15 since: < 16
    assert controller.decide(load(kv=0.3, running=16), in_flight=16, ended=131).window == 17


def test_an_engine_restart_is_no_cut():
    controller = Controller(Limits(floor=4))
    controller.decide(load(preemptions=100), in_flight=4)
    assert controller.decide(load(preemptions=0), in_flight=4).preempted == 0


def test_requests_waiting_beyond_the_allowance_trim_the_window_by_the_excess():
    controller = Controller(Limits(floor=1, ceiling=64, waiting_allowance=0.1))
    controller.window = 40
    decision = controller.decide(load(kv=0.5, running=30, waiting=10), in_flight=40)  # allowance: 3
    assert (decision.action, decision.window) == ("trim", 33)


def test_a_short_queue_within_the_allowance_holds_the_window():
    controller = Controller(Limits(floor=20, ceiling=64, waiting_allowance=0.1))
    decision = controller.decide(load(kv=0.2, running=20, waiting=2), in_flight=20)
    assert (decision.action, decision.window) == ("hold", 20)


def test_the_floor_bounds_every_cut():
    controller = Controller(Limits(floor=3, ceiling=64))
    controller.decide(load(kv=0.8, running=3), in_flight=3)  # the baseline; holds at the target
    decision = controller.decide(load(kv=1.0, running=3, preemptions=9), in_flight=3)
    assert (decision.action, decision.window) == ("hold", 3) and "at the floor" in decision.reason


def test_an_unread_load_holds_the_window():
    controller = Controller(Limits(floor=5))
    decision = controller.decide(None, in_flight=5)
    assert (decision.action, decision.window) == ("hold", 5)


def test_limits_refuse_a_floor_over_the_ceiling_and_marks_out_of_order():
    with pytest.raises(ValueError, match="floor 9, ceiling 4"):
        Limits(floor=9, ceiling=4)
    with pytest.raises(ValueError, match="kv_target < kv_high"):
        Limits(kv_target=0.9, kv_high=0.8)


def test_the_load_over_engines_counts_each_url_once_and_skips_unread_ones():
    engines = [
        admin_pb.EngineLoad(url="a", kv_cache_usage=0.5, requests_running=4, requests_waiting=1, preemptions_total=2),
        admin_pb.EngineLoad(url="a", kv_cache_usage=0.5, requests_running=4, requests_waiting=1, preemptions_total=2),
        admin_pb.EngineLoad(url="b", kv_cache_usage=0.8, requests_running=6, preemptions_total=1),
        admin_pb.EngineLoad(url="c", error="GET http://c/metrics failed"),
    ]
    assert Load.of(engines) == Load(0.8, 10, 1, 3, unread=1)
    assert Load.of([admin_pb.EngineLoad(url="c", error="down")]) is None


async def test_the_driver_sets_the_window_each_interval_and_tells_every_decision():
    loads = iter([load(), load(), load(kv=0.95, running=4)])
    applied: list[int] = []
    told: list[Decision] = []
    done = asyncio.Event()

    async def read() -> Load | None:
        value = next(loads, None)
        if value is None:
            done.set()
        return value

    admission = Admission(
        Controller(Limits(floor=1, ceiling=8, interval=0.001)),
        read,
        applied.append,
        lambda: applied[-1],  # always full
        lambda at, decision: told.append(decision),
    )
    task = asyncio.create_task(admission.run())
    await done.wait()
    task.cancel()
    assert applied[:4] == [1, 2, 4, 3]
    assert [d.action for d in told[:4]] == ["start", "grow", "grow", "cut"]
    assert "window 3 at the end" in admission.summary() or "between 1 and 4" in admission.summary()


async def test_the_decisions_are_served_as_prometheus_metrics():
    """What `collect --admission-metrics-port` serves: the window, the decisions, the last load read."""
    loads = iter([load(), load(kv=0.95, running=4, waiting=2)])
    applied: list[int] = []
    admission = Admission(Controller(Limits(floor=1, ceiling=8)), lambda: _next(loads), applied.append, lambda: 1)
    admission.start()
    for _ in range(2):
        decision = admission.controller.decide(await admission.read_load(), admission.in_flight())
        admission.apply(decision.window)
        admission._note(0.0, decision)
    endpoint = admission_metrics.serve(admission, "127.0.0.1", 0)
    try:
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{endpoint.address}/metrics", timeout=10).read().decode()
        )
    finally:
        await endpoint.stop()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("gym_admission_window", ())] == applied[-1] == admission.controller.window
    assert samples[("gym_admission_decisions_total", (("action", "start"),))] == 1
    assert sum(v for (name, _), v in samples.items() if name == "gym_admission_decisions_total") == 3
    assert samples[("gym_admission_kv_cache_usage", ())] == 0.95
    assert samples[("gym_admission_requests_waiting", ())] == 2
    assert samples[("gym_admission_ceiling", ())] == 8 and samples[("gym_admission_rollouts_in_flight", ())] == 1


async def _next(values):
    return next(values)


# vLLM's /metrics, parsed.


def test_the_load_in_a_real_vllm_0_32_metrics_page():
    parsed = engine_load.parse("http://e/v1", VLLM_METRICS)
    assert parsed == admin_pb.EngineLoad(
        url="http://e/v1",
        kv_cache_usage=0.967741935483871,
        requests_running=15,
        requests_waiting=15,
        preemptions_total=31,
    )


def test_an_older_vllms_gpu_cache_name_is_read():
    text = metrics_text(0.4, 3, 0, 0).replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert engine_load.parse("u", text).kv_cache_usage == 0.4


def test_series_of_several_engines_add_up_and_the_fullest_kv_cache_counts():
    text = metrics_text(0.3, 2, 1, 5, engine="0") + metrics_text(0.6, 3, 0, 1, engine="1").replace("# TYPE", "# X")
    parsed = engine_load.parse("u", text)
    assert (parsed.kv_cache_usage, parsed.requests_running, parsed.requests_waiting, parsed.preemptions_total) == (
        0.6,
        5,
        1,
        6,
    )


def test_metrics_without_vllms_names_give_an_error_naming_them():
    parsed = engine_load.parse("u", "# TYPE up gauge\nup 1\n")
    assert parsed.error.startswith("its /metrics has no vllm:kv_cache_usage_perc, vllm:num_requests_running")
    assert engine_load.parse("u", "this is { not prometheus").error


# A model server reads its engine's /metrics over loopback.


async def test_an_engine_that_never_answers_its_metrics_leaves_status_its_model_servers_row():
    """The engine is a socket that listens and never answers: GetCounters must still answer within the
    2 s that `status` gives it, the engine marked as not read, not the model server as down."""
    silent = socket.create_server(("127.0.0.1", 0))
    model = VLLMModel({"base_url": f"http://127.0.0.1:{silent.getsockname()[1]}/v1", "model": "m"}, name="model")
    server = await serve(model, "127.0.0.1", 0)
    try:
        [row] = await observe.status(static_registry(model=server), interval=0.01)
    finally:
        await server.stop()
        silent.close()
    assert row["health"] == "serving" and row["open_files_limit"] > 0
    assert "did not answer within" in row["engines"][0]["error"]


async def test_a_model_server_reports_its_engines_load_in_counters_status_and_metrics(start):
    fake = FakeEngine([Turn(content="ok")])
    await fake.start()
    fake.metrics = VLLM_METRICS
    down = FakeEngine()
    await down.start()  # serves no /metrics: a 404
    model = VLLMModel({"base_url": [fake.base_url, down.base_url], "model": "m"}, name="model")
    server = await serve(model, "127.0.0.1", 0, metrics_port=0)
    try:
        async with transport.open_channel(server.address) as channel:
            counters = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
        read, unread = counters.engines
        assert (read.url, read.kv_cache_usage, read.requests_running, read.requests_waiting) == (
            fake.base_url,
            pytest.approx(0.9677, abs=1e-4),
            15,
            15,
        )
        assert (read.preemptions_total, read.error) == (31, "")
        assert unread.url == down.base_url and "answered HTTP 404" in unread.error

        fake.metrics = metrics_text(0.25, 3, 0, 40)  # read again at each ask: the engine's load now
        [row] = await observe.status(static_registry(model=server), interval=0.01)
        assert row["engines"][0] == {
            "url": fake.base_url,
            "kv_cache_usage": 0.25,
            "requests_running": 3,
            "requests_waiting": 0,
            "preemptions_total": 40,
        }
        lines = observe.format_status([row]).splitlines()
        said = f"  engine {fake.base_url}: KV cache 25% used, 3 running, 0 waiting, 40 preemptions since it started"
        assert said in lines
        assert any(line.startswith(f"  engine {down.base_url}: load not read: GET ") for line in lines)

        scraped = await asyncio.to_thread(_scrape, model.metrics_address)
        assert scraped["gym_engine_kv_cache_usage"] == {fake.base_url: 0.25}
        assert scraped["gym_engine_requests_running"] == {fake.base_url: 3}
        assert scraped["gym_engine_preemptions_total"] == {fake.base_url: 40}
        assert scraped["gym_engine_load_up"] == {fake.base_url: 1, down.base_url: 0}
    finally:
        await server.stop(grace=0.5)
        await fake.stop()
        await down.stop()


def _scrape(address: str) -> dict[str, dict[str, float]]:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("gym_engine_"):
                out.setdefault(sample.name, {})[sample.labels["engine"]] = sample.value
    return out


# collect --admission engine.


async def _stack(start, fake: FakeEngine) -> Registry:
    model = await start(VLLMModel({"base_url": fake.base_url, "model": "m"}, name="model"))
    calc = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc", "max_steps": 1},
            name="agent",
            registry=static_registry(model=model, calc=calc),
        )
    )
    registry_app = RegistryServer()
    registry_app.servicer.add(reg.ServerInfo(name="model", addresses=[model.address]))
    registry_app.servicer.add(reg.ServerInfo(name="calc", addresses=[calc.address]))
    registry_app.servicer.add(
        reg.ServerInfo(name="agent", addresses=[agent.address], references={"model": "model", "resources": "calc"})
    )
    return Registry((await start(registry_app)).address)


async def test_collect_with_engine_admission_keeps_a_full_engine_at_the_floor(start, tmp_path):
    fake = FakeEngine(lambda body: Turn(content="ok"))
    await fake.start()
    fake.metrics = metrics_text(0.99, 2, 6, 0)  # a KV cache over its high mark the whole run
    registry = await _stack(start, fake)
    rows = [{"responses_create_params": {"input": f"task {i}"}} for i in range(12)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = CollectOptions(
        input=tmp_path / "tasks.jsonl",
        output=tmp_path / "out.jsonl",
        agent="agent",
        progress=False,
        admission=Limits(floor=2, ceiling=8, interval=0.01),
        admission_log=tmp_path / "admission.jsonl",
    )
    try:
        summary = await collect(registry, options, log=io.StringIO())
    finally:
        await registry.close()
        await fake.stop()
    assert summary.done == 12 and summary.failed == 0
    decisions = [json.loads(line) for line in (tmp_path / "admission.jsonl").read_text().splitlines()]
    assert decisions[0]["action"] == "start" and decisions[0]["window"] == 2
    assert {d["window"] for d in decisions} == {2}
    assert all(d["action"] == "hold" and d["kv_cache_usage"] == 0.99 for d in decisions[1:])
    assert summary.admission is not None and "between 2 and 2 (floor 2, ceiling 8)" in summary.admission


class BarrierEngine(FakeEngine):
    """Answers no generation until `n` wait at once: rollouts end only once the window reached n."""

    def __init__(self, n: int) -> None:
        super().__init__(lambda body: Turn(content="ok"))
        self.n = n
        self.waiting = 0
        self.open = asyncio.Event()

    async def _gate(self, request):
        self.waiting += 1
        if self.waiting >= self.n:
            self.open.set()
        await self.open.wait()
        return await super()._gate(request)


async def test_collect_with_engine_admission_grows_the_window_on_an_idle_engine(start, tmp_path):
    fake = BarrierEngine(4)
    await fake.start()
    fake.metrics = metrics_text(0.0, 0, 0, 0)  # an empty KV cache, nothing waiting: room to grow
    registry = await _stack(start, fake)
    rows = [{"responses_create_params": {"input": f"task {i}"}} for i in range(8)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = CollectOptions(
        input=tmp_path / "tasks.jsonl",
        output=tmp_path / "out.jsonl",
        agent="agent",
        progress=False,
        admission=Limits(floor=1, ceiling=8, interval=0.01),
        admission_log=tmp_path / "admission.jsonl",
        admission_metrics_port=0,  # served while it runs (what it serves: the test above)
    )
    try:
        # Without growth the first rollout would wait for ever: a bound, to fail instead of hanging.
        summary = await asyncio.wait_for(collect(registry, options, log=io.StringIO()), 120)
    finally:
        await registry.close()
        await fake.stop()
    assert summary.done == 8 and summary.failed == 0
    decisions = [json.loads(line) for line in (tmp_path / "admission.jsonl").read_text().splitlines()]
    grown = [d["window"] for d in decisions if d["action"] == "grow"]
    assert grown[:2] == [2, 4]  # doubling while the window is full and the KV cache empty
    assert (decisions[0]["action"], decisions[0]["window"]) == ("start", 1)


async def test_gym_clients_limit_follows_the_engine_while_limiting_rollouts(start):
    fake = BarrierEngine(4)
    await fake.start()
    fake.metrics = metrics_text(0.0, 0, 0, 0)
    registry = await _stack(start, fake)
    before = training.max_concurrent_rollouts()
    told: list[Decision] = []
    limits = Limits(1, 8, interval=0.01)
    try:
        async with (
            limiting_rollouts(registry, "agent", limits=limits, record=lambda at, d: told.append(d)),
            GymClient("agent", registry) as gym,
        ):
            assert training.max_concurrent_rollouts() == 1  # the floor, at once
            # Four at once or none ends: the limit has to grow from 1 to 4 (bounded, to fail, not hang).
            results = await asyncio.wait_for(
                asyncio.gather(*(gym.run({"responses_create_params": {"input": f"t{i}"}}) for i in range(4))), 120
            )
        assert all(result.ok for result in results)
        assert [d.window for d in told if d.action == "grow"][:2] == [2, 4]
        assert training.max_concurrent_rollouts() == before  # set back after the block
    finally:
        await registry.close()
        await fake.stop()


def test_admission_options_without_admission_engine_are_refused(tmp_path):
    (tmp_path / "tasks.jsonl").write_text("{}\n")
    args = ["collect", "--input", str(tmp_path / "tasks.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    result = CliRunner().invoke(cli, [*args, "--min-in-flight", "4"])
    assert result.exit_code == 2 and "--min-in-flight is for --admission engine" in result.output
    result = CliRunner().invoke(cli, [*args, "--admission", "engine", "--min-in-flight", "9", "--max-in-flight", "4"])
    assert result.exit_code == 2 and "floor 9, ceiling 4" in result.output
