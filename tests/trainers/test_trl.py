"""TRL's GRPOTrainer trained on rollouts collected through gym-grpc (gym_grpc.adapters.trl), on CPU.

The step test runs it end to end: the real CPU vLLM serving SmolLM2-135M-Instruct, `gym-grpc
run configs/vllm.yaml` with the math environment, GymRollouts as GRPOTrainer's rollout_func, and
one GRPO optimizer step on the same model's weights loaded with transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine.gym_cli import MATH_CONFIG, VLLM, serving
from tests.support import start_run

pytestmark = pytest.mark.trainers

QUICKSTART_MATH = (Path(__file__).parents[2] / "configs" / "local_policy.yaml", MATH_CONFIG)


def _task(question: str, answer: str, **params: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}], **params},
        "expected_answer": answer,
    }


def _trainer(model_dir: Path, output_dir: Path, rollout_func: Any, dataset: Any, group: int, prompts: int) -> Any:
    """A GRPOTrainer on CPU over SmolLM2-135M-Instruct's weights (as the engine serves them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from gym_grpc.adapters.trl import gym_reward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=group * prompts,
        num_generations=group,
        max_steps=1,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    return GRPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        reward_funcs=gym_reward,
        train_dataset=dataset,
        rollout_func=rollout_func,
    )


def test_one_grpo_step_on_smollm2_rollouts_collected_through_gym_grpc(
    engine: local_vllm.Engine, model_dir: Path, tmp_path: Path
) -> None:
    import torch

    from gym_grpc.adapters.trl import GymRollouts

    # SmolLM2-135M gets "1 + 1" right most of the time and "2 + 3" about a quarter of the time
    # (measured at temperature 1), so groups of 4 are mostly mixed: a GRPO step needs a group whose
    # rewards differ, else every advantage is 0. The seeds make the samples repeatable, though
    # not exactly: vLLM's CPU numerics vary with what it batches together (seen: the last of
    # the 8 rewards 1 in one run, 0 in the next).
    tasks = [
        _task("What is 1 + 1? Put the final answer in \\boxed{}.", "2", max_output_tokens=48, temperature=1.0),
        _task("What is 2 + 3?", "5", max_output_tokens=48, temperature=1.0),
    ]
    seen: list[dict[str, Any]] = []
    with serving(engine, tmp_path, VLLM, MATH_CONFIG) as run:
        rollouts = GymRollouts("math_agent", tasks, run.registry, seed=0)

        def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            out = rollouts(prompts, trainer)
            seen.append(out)
            return out

        trainer = _trainer(model_dir, tmp_path / "out", rollout_func, rollouts.dataset(), group=4, prompts=2)
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        try:
            result = trainer.train()
        finally:
            rollouts.close()

    assert rollouts.stats.rollouts == 8 and rollouts.stats.failed == 0, rollouts.stats
    (out,) = seen
    for prompt, completion, mask, logprobs in zip(
        out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"], strict=True
    ):
        assert prompt and completion and len(mask) == len(completion) == len(logprobs)
        assert all(lp <= 0.0 for lp in logprobs) and any(lp < 0.0 for lp in logprobs)  # the engine's log-probs
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    loss = logged["loss"]
    assert math.isfinite(loss) and math.isfinite(result.training_loss)
    rewards = out["gym_reward"]
    assert logged["rewards/gym_reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])]
    print(
        f"\nTRL GRPO step on SmolLM2-135M through gym-grpc: rewards {rewards}, loss {loss!r}, "
        f"{len(changed)} of {len(before)} parameter tensors changed"
    )
    assert changed, f"no parameter changed (rewards {rewards}: a group whose rewards all agree has no advantage)"


def test_failed_rollouts_reach_trl_as_unscorable_members_not_reward_zero(model_dir: Path, tmp_path: Path) -> None:
    """A task the math environment refuses (no expected_answer) fails every rollout of its group:
    those come back masked (env_mask 0, reward None) and TRL's reward mean leaves them out."""
    from gym_grpc.adapters.trl import GymRollouts

    tasks = [
        _task("What is 17 + 25? Put the final answer in \\boxed{}.", "42", temperature=0.0),
        {"responses_create_params": {"input": [{"role": "user", "content": "What is 2 + 2?"}]}},
    ]
    seen: list[dict[str, Any]] = []
    run = start_run(configs=QUICKSTART_MATH)
    try:
        rollouts = GymRollouts("math_agent", tasks, run.registry)

        def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            out = rollouts(prompts, trainer)
            seen.append(out)
            return out

        trainer = _trainer(model_dir, tmp_path / "out", rollout_func, rollouts.dataset(), group=2, prompts=2)
        try:
            trainer.train()
        finally:
            rollouts.close()
    finally:
        run.stop()

    (out,) = seen
    prompts = [json.dumps(p) for p in out["prompt_ids"]]
    assert rollouts.stats.rollouts == 4 and rollouts.stats.failed == 2, rollouts.stats
    failed = [i for i, reward in enumerate(out["gym_reward"]) if reward is None]
    finished = [i for i, reward in enumerate(out["gym_reward"]) if reward is not None]
    assert len(failed) == 2 and len(finished) == 2
    for i in failed:
        assert out["env_mask"][i] == [0] and out["logprobs"][i] == [0.0]
        assert "INVALID_ARGUMENT" in out["gym_failure"][i] and "expected_answer" in out["gym_failure"][i]
    for i in finished:
        assert out["gym_reward"][i] == 1.0 and out["gym_failure"][i] is None and 1 in out["env_mask"][i]
    assert len(set(prompts)) == 2  # the failed group, with no prompt ids of its own, gets a one-id placeholder
    logged = next(entry for entry in trainer.state.log_history if "rewards/gym_reward/mean" in entry)
    # Reward 0 for the failed members would make this 0.5.
    assert logged["rewards/gym_reward/mean"] == pytest.approx(1.0)


def test_a_tool_calling_rollout_is_one_completion_with_the_tools_ids_masked(model_dir: Path, tmp_path: Path) -> None:
    """The weather agent calls get_weather, then answers: two generations with the tool's output
    between them, one TRL completion whose env_mask is 1 on the generations only. The rollout
    function is called as GRPOTrainer calls it (its batch's prompts, the trainer itself), without
    the optimizer step: the local policy's byte-level ids make long sequences, slow on CPU."""
    from gym_grpc.adapters.trl import GymRollouts

    lines = (Path(__file__).parents[2] / "servers/resources/weather/data/example.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines[:2]]
    for task in tasks:
        task["responses_create_params"]["temperature"] = 0.0  # the local policy calls the tool without slips
    run = start_run(configs=(QUICKSTART_MATH[0], Path(__file__).parents[2] / "servers/resources/weather/config.yaml"))
    try:
        rollouts = GymRollouts("weather_agent", tasks, run.registry)
        dataset = rollouts.dataset()
        trainer = _trainer(model_dir, tmp_path / "out", rollouts, dataset, group=2, prompts=2)
        prompts = [row["prompt"] for row in dataset for _ in range(2)]  # as its RepeatSampler orders them
        try:
            out = rollouts(prompts, trainer)
        finally:
            rollouts.close()
    finally:
        run.stop()

    assert out["gym_reward"] == [1.0] * 4 and rollouts.stats.failed == 0
    assert out["prompt_ids"][0] == out["prompt_ids"][1] != out["prompt_ids"][2] == out["prompt_ids"][3]
    for completion, mask, logprobs in zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True):
        assert len(completion) == len(mask) == len(logprobs)
        generations = [run_ for run_ in "".join(map(str, mask)).split("0") if run_]
        assert len(generations) == 2, mask  # the tool call, then the answer, with the tool's output between
        assert mask[0] == 1 and mask[-1] == 1
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
