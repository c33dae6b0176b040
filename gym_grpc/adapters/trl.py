"""TRL's GRPOTrainer over a running gym-grpc: its `rollout_func` and a reward function.

    rollouts = GymRollouts("math_agent", task_rows, registry="127.0.0.1:50050")
    trainer = GRPOTrainer(
        model=model, args=GRPOConfig(num_generations=4, ...), processing_class=tokenizer,
        train_dataset=rollouts.dataset(), reward_funcs=gym_reward, rollout_func=rollouts,
    )
    trainer.train()
    rollouts.close()

TRL calls `rollout_func(prompts, trainer)` with the batch's prompts, each
dataset prompt repeated `num_generations` times in a row (its RepeatSampler),
and wants back, per prompt, `prompt_ids`, `completion_ids` and `logprobs`;
an `env_mask` (1 on ids the model generated, 0 on ids it did not) is its loss
mask for multi-turn completions, and any other field reaches the reward
functions as a keyword argument. Here each run of repeated prompts is one
GRPO group: `GymClient.run_group` runs it through the agent, and every member
becomes one completion, built by `gym_grpc.training`: the first turn's prompt
ids, then every generation (mask 1, the engine's log-probs) with the
template's and tools' ids between them (mask 0). So a multi-turn rollout
trains on exactly the ids the model saw and sampled.

A failed rollout (a server down, a deadline, a verifier that raised) must not
become a reward-0 sample. TRL takes a reward of None from every reward
function as "unscorable": the member is left out of its group's mean and std
and its advantage is 0. So such a member is returned as a placeholder
completion of one EOS id with `env_mask` 0 (no token of it reaches the loss),
`gym_reward` None, and why it failed in `gym_failure`. A rollout whose
history was not monotonic (it would be two samples, and TRL takes one
completion per prompt) is masked the same way and counted.

TRL hands `rollout_func` only the prompts, not the dataset rows, so the task
of a prompt is found by the prompt: `dataset()` holds one prompt per task,
and two different tasks with the same prompt are refused up front.

The engine samples with its own weights, not the trainer's: TRL does not
reach a gym-grpc engine to sync them, so the caller reloads the engine's
weights (or restarts it from a checkpoint) as often as it wants the samples
on-policy; until then the rollouts are off-policy by the steps since.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from gym_grpc.client import GymClient, RolloutResult
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security
from gym_grpc.training import SampleStats, TrainingRollout, samples_of

T = TypeVar("T")

#: The extra fields the rollout function adds for the reward functions.
REWARD_FIELD = "gym_reward"
FAILURE_FIELD = "gym_failure"


def gym_reward(completions: Sequence[Any], gym_reward: Sequence[float | None], **kwargs: Any) -> list[float | None]:
    """The reward function to give GRPOTrainer with `GymRollouts`: each rollout's reward from its
    environment's verifier, None (unscorable, advantage 0) for a failed or masked member."""
    return list(gym_reward)


def prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """A task row's input as chat messages ({role, content} with text content), as TRL's dataset holds them."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise ValueError("a task row needs responses_create_params")
    messages = []
    if isinstance(params.get("instructions"), str):
        messages.append({"role": "system", "content": params["instructions"]})
    given = params.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list):
        raise ValueError("responses_create_params.input must be a string or a list of items")
    for item in given:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ValueError(f"responses_create_params.input has an item that is no message: {item!r:.200}")
        messages.append({"role": item["role"], "content": _text(item.get("content"))})
    return messages


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _seeded(row: dict[str, Any], seed: int) -> dict[str, Any]:
    """The row with `seed` in its engine options (`responses_create_params.metadata.extra_body`)."""
    params = dict(row["responses_create_params"])
    metadata = dict(params.get("metadata") or {})
    extra = json.loads(metadata.get("extra_body") or "{}")
    metadata["extra_body"] = json.dumps({**extra, "seed": seed})
    params["metadata"] = metadata
    return {**row, "responses_create_params": params}


def _key(prompt: Any) -> str:
    """One prompt's identity, the same for a task row's messages and the copy TRL hands back (a
    dataset may add keys set to None to every message, and a plain-string prompt is a user message)."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return json.dumps([[m.get("role"), _text(m.get("content"))] for m in prompt], ensure_ascii=False)


@dataclass
class RolloutStats:
    """What the rollout function met, over every call."""

    rollouts: int = 0
    #: Failed rollouts, each a masked member.
    failed: int = 0
    #: Rollouts whose history was not monotonic (two samples), each a masked member.
    non_monotonic: int = 0


class GymRollouts:
    """TRL GRPOTrainer's `rollout_func` (call it as `rollouts(prompts, trainer)`) over an agent of a
    running `gym-grpc run`, for the task rows given; `dataset()` is their prompts."""

    def __init__(
        self,
        agent: str,
        tasks: Sequence[dict[str, Any]],
        registry: str | Registry = "127.0.0.1:50050",
        *,
        timeout: float = 3600.0,
        security: Security | None = None,
        seed: int | None = None,
    ) -> None:
        self.agent = agent
        #: With a seed, the n-th rollout this object runs asks the engine for seed + n (in
        #: `metadata.extra_body`, as NeMo Gym's num_repeats_add_seed does): reproducible, and
        #: distinct for every member of every group. None: the engine's own randomness.
        self.seed = seed
        self._rollouts_run = 0
        self.tasks = list(tasks)
        self._registry = registry
        self._timeout = timeout
        self._security = security
        self._by_prompt: dict[str, int] = {}
        for index, row in enumerate(self.tasks):
            key = _key(prompt_messages(row))
            seen = self._by_prompt.setdefault(key, index)
            if seen != index and self.tasks[seen] != row:
                raise ValueError(
                    f"tasks {seen} and {index} have the same prompt but differ: TRL gives rollout_func only "
                    "the prompts, so it could not tell them apart"
                )
        self.stats = RolloutStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: GymClient | None = None

    def dataset(self) -> Any:
        """A `datasets.Dataset` with one `prompt` (chat messages) per distinct task, for train_dataset."""
        import datasets

        return datasets.Dataset.from_list(
            [{"prompt": prompt_messages(self.tasks[i])} for i in self._by_prompt.values()]
        )

    # --- the event loop the client lives on (TRL calls rollout_func from its own thread) ---

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="gym-grpc-trl", daemon=True)
            self._thread.start()
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result()

    async def _groups(self, tasks: list[int], size: int) -> list[list[RolloutResult]]:
        if self._client is None:
            self._client = GymClient(self.agent, self._registry, timeout=self._timeout, security=self._security)
        client = self._client
        if self.seed is None:
            return list(await asyncio.gather(*(client.run_group(self.tasks[t], size) for t in tasks)))
        first, self._rollouts_run = self._rollouts_run, self._rollouts_run + len(tasks) * size
        seeded = [
            [_seeded(self.tasks[t], self.seed + first + g * size + k) for k in range(size)] for g, t in enumerate(tasks)
        ]
        runs = [asyncio.gather(*(client.run(row) for row in group)) for group in seeded]
        return [list(group) for group in await asyncio.gather(*runs)]

    def close(self) -> None:
        """Close the client and stop its event loop (the object is done with)."""
        if self._loop is None:
            return
        if self._client is not None:
            self._run(self._client.close())
            self._client = None
        self._run(_wind_down())
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join()
        self._loop.close()
        self._loop = None

    # --- rollout_func ---

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        if len(prompts) % size:
            raise ValueError(f"{len(prompts)} prompts is no whole number of groups of {size}")
        tasks = []
        for start in range(0, len(prompts), size):
            keys = {_key(p) for p in prompts[start : start + size]}
            if len(keys) != 1:
                raise ValueError(f"prompts {start}..{start + size - 1} should be one prompt repeated (a GRPO group)")
            key = keys.pop()
            if key not in self._by_prompt:
                raise ValueError(f"prompt {start} is none of the tasks' prompts: {key[:200]}")
            tasks.append(self._by_prompt[key])
        groups = self._run(self._groups(tasks, size))
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        return self._completions(tasks, groups, tokenizer.eos_token_id)

    def _completions(self, tasks: list[int], groups: list[list[RolloutResult]], eos: int) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            REWARD_FIELD: [],
            FAILURE_FIELD: [],
        }
        for task, group in zip(tasks, groups, strict=True):
            members: list[tuple[list[int], list[int], list[float], list[int], float | None] | str] = []
            for k, result in enumerate(group):
                self.stats.rollouts += 1
                stats = SampleStats()
                samples = samples_of(TrainingRollout.from_result(result, self.agent, task, k), "split", stats)
                if stats.failed:
                    self.stats.failed += 1
                    members.append(samples[0].failure or "failed")
                elif stats.without_ids:
                    raise ValueError(
                        f"agent {self.agent!r} returned a rollout without token ids: its model server must "
                        "report them (return_token_ids: true, as configs/vllm.yaml sets)"
                    )
                elif len(samples) > 1:
                    self.stats.non_monotonic += 1
                    members.append(f"non-monotonic history: {len(samples)} samples, TRL takes one completion")
                else:
                    s = samples[0]
                    members.append((s.prompt_ids, s.response_ids, s.response_log_probs, s.response_mask, s.reward))
            # A masked member still needs a prompt: its group's, when any member finished.
            group_prompt = next((m[0] for m in members if not isinstance(m, str)), [eos])
            for member in members:
                failure = member if isinstance(member, str) else None
                if isinstance(member, str):
                    member = (group_prompt, [eos], [0.0], [0], None)
                prompt_ids, completion_ids, logprobs, mask, reward = member
                out["prompt_ids"].append(list(prompt_ids))
                out["completion_ids"].append(list(completion_ids))
                out["logprobs"].append(list(logprobs))
                out["env_mask"].append(list(mask))
                out[REWARD_FIELD].append(reward)
                out[FAILURE_FIELD].append(failure)
        return out


async def _wind_down() -> None:
    """End what still runs on the loop (gRPC's own tasks among them) before it closes, as
    asyncio.run does: a task left pending would be finalised later, wherever the garbage
    collector happens to run."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
