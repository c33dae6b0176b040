"""Weight updates of the real CPU vLLM under a running collection (ModelService.UpdateWeights).

`gym-grpc run configs/vllm.yaml` with the math environment; a trainer's loop keeps 4 rollouts in
flight, starting new ones until it has updated twice, and, each time the engine's own count says a
generation is running, updates the weights: version 1 is a copy of the model with its embeddings
perturbed, version 2 the model again (version 0, the model, is loaded before the first rollout, as a
trainer's step 0 does). In each pause mode: no rollout is lost; the turns the updates caught are what the mode says
(spanning two versions with keep, generated again with abort, neither with wait); and every
generated token's version is the one that sampled it: the log-probs its turn recorded are the ones
the weights of its version give it (scored again afterwards, prefill only), and not the ones the
other weights give it. So generations change with the weights, and the stamps are true.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.client import GymClient
from gym_grpc.client.stubs import ModelClient
from gym_grpc.engines import local_vllm
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from tests.real_engine import checkpoints, gym_cli
from tests.real_engine.test_cancellation import EngineRequests
from tests.support import run_status

pytestmark = pytest.mark.real_engine

IN_FLIGHT = 4
#: Rollouts started at most: more than the updates need (about 12), a bound should the engine never
#: be seen generating.
MAX_ROLLOUTS = 60
#: Bounds on the mean |log-prob difference| of tokens re-scored by the weights that sampled them
#: (prefill rather than decode, other batches) and by the others. Measured: 0.000–0.005 and 2.1–3.9 nats.
SAME, OTHER = 0.15, 0.5


def _task(k: int) -> dict[str, Any]:
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"Tell me a long story about cat number {k}, then add 1 + 1."}],
            "max_output_tokens": 64,
            "temperature": 1.0,
            "seed": k,
        },
        "expected_answer": "2",
    }


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoints.perturbed(local_vllm.prepare().model_dir, tmp_path_factory.mktemp("perturbed"))


@pytest.fixture
def restored(engine: local_vllm.Engine):
    """The engine as the other tests know it afterwards: the model's own weights, vLLM's own label."""
    yield engine
    _reload(engine, str(local_vllm.prepare().model_dir))
    gym_cli.post_json(f"{engine.base_url.removesuffix('/v1')}/update_weight_version", {"new_version": "default"})


def _reload(engine: local_vllm.Engine, path: str) -> None:
    """Load a checkpoint into the engine, straight through vLLM's API (nothing in flight)."""
    root = engine.base_url.removesuffix("/v1")
    gym_cli.post_json(f"{root}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})


def _versions(item: r.Item) -> list[int]:
    """The version of each generated token of a turn."""
    body = getattr(item, item.WhichOneof("item"))
    if body.policy_version_spans:
        return [s.version for s in body.policy_version_spans for _ in range(s.start, s.end)]
    return [body.policy_version] * len(body.generation_token_ids)


def _score(engine: local_vllm.Engine, body: Any) -> list[float]:
    """The log-probs the engine's current weights give a turn's generated tokens (prefill only)."""
    prompt, generated = list(body.prompt_token_ids), list(body.generation_token_ids)
    answer = gym_cli.post_json(
        f"{engine.base_url}/completions",
        {"model": engine.model, "prompt": prompt + generated, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0},
    )
    scored = answer["choices"][0]["prompt_logprobs"][len(prompt) :]
    return [entry[str(token)]["logprob"] for entry, token in zip(scored, generated, strict=True)]


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_updates_under_a_collection_lose_no_rollout_and_stamp_every_token_with_its_weights(
    restored: local_vllm.Engine, perturbed: Path, tmp_path: Path, mode: str
) -> None:
    engine, model_dir = restored, str(local_vllm.prepare().model_dir)
    weights = {0: model_dir, 1: str(perturbed), 2: model_dir}
    with gym_cli.serving(engine, tmp_path, gym_cli.VLLM, gym_cli.MATH_CONFIG) as run:

        async def collect() -> list[Any]:
            registry = Registry(run.registry)
            model, requests = ModelClient(registry, "policy_model"), EngineRequests(engine)
            await model.update_weights(0, weights[0], mode)
            async with GymClient("math_agent", registry) as gym:
                slots = asyncio.Semaphore(IN_FLIGHT)
                updated = False
                runs: list[asyncio.Future[Any]] = []

                async def one(k: int) -> Any:
                    try:
                        return await gym.run(_task(k))
                    finally:
                        slots.release()

                async def produce() -> None:
                    """New rollouts until both updates are done: with a fixed number, the last ones
                    could all end (their generations end together) before the second update saw one
                    generating, and in wait mode the first update holds the collection for a while."""
                    for k in range(MAX_ROLLOUTS):
                        await slots.acquire()
                        if updated:
                            return
                        runs.append(asyncio.ensure_future(one(k)))

                producer = asyncio.ensure_future(produce())
                for version in (1, 2):
                    finished = sum(run.done() for run in runs)
                    # A rollout finished under the version before (else abort would leave it no token),
                    # and a generation in flight for the update to catch.
                    while sum(run.done() for run in runs) == finished or await requests.count() == 0:
                        assert not producer.done(), f"all {MAX_ROLLOUTS} rollouts started before update {version}"
                        await asyncio.sleep(0.05)
                    (answer,) = await model.update_weights(version, weights[version], mode)
                    assert answer.updated and answer.previous == version - 1
                    assert [e.engine for e in answer.engines] == [engine.base_url]
                updated = True
                await producer
                results = await asyncio.gather(*runs)
            await registry.close()
            return results

        results = asyncio.run(collect())
        _, status = run_status(run.registry)
    assert [result.failure for result in results] == [None] * len(results)  # no rollout lost
    turns = [item for result in results for item in result.rollout.response.output if item.message.generation_token_ids]
    assert len(turns) == len(results)
    caught = status["policy_model"]["turns_caught_by_update"]
    spanning = [turn for turn in turns if turn.message.policy_version_spans]
    if mode == "keep":
        assert spanning and caught.get("spanning", 0) == len(spanning) and "regenerated" not in caught
    elif mode == "abort":
        assert caught.get("regenerated", 0) >= 1 and not spanning and "spanning" not in caught
    else:
        assert caught == {} and not spanning
    versions = [_versions(turn) for turn in turns]
    assert {v for vs in versions for v in vs} <= {0, 1, 2}
    for turn in spanning:
        assert turn.message.policy_version == min(_versions(turn))

    # Every token against the weights of its version, and against the others.
    # The engine holds the model's weights (version 2); then the perturbed ones (`restored` undoes it).
    scores = {"model": [_score(engine, turn.message) for turn in turns]}
    _reload(engine, str(perturbed))
    scores["perturbed"] = [_score(engine, turn.message) for turn in turns]
    by_weights: dict[str, list[tuple[float, float]]] = {"model": [], "perturbed": []}  # (own, other)
    for turn, vs, on_model, on_perturbed in zip(turns, versions, scores["model"], scores["perturbed"], strict=True):
        recorded = list(turn.message.generation_log_probs)
        for i, v in enumerate(vs):
            own, other = (on_perturbed[i], on_model[i]) if v == 1 else (on_model[i], on_perturbed[i])
            by_weights["perturbed" if v == 1 else "model"].append((abs(recorded[i] - own), abs(recorded[i] - other)))
    for name, pairs in by_weights.items():
        if not pairs:
            continue
        same = sum(p[0] for p in pairs) / len(pairs)
        other = sum(p[1] for p in pairs) / len(pairs)
        assert same < SAME and other > OTHER, (name, len(pairs), same, other)
    assert by_weights["perturbed"], "no token was sampled by version 1"
