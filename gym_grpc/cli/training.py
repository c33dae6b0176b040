"""`gym-grpc samples` and `gym-grpc set-policy-version`: rollouts for a trainer, the policy a model server serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from gym_grpc import training
from gym_grpc.cli.options import registry_option, security_options, with_registry
from gym_grpc.client.stubs import PAUSE_MODES, UPDATE_TIMEOUT, ModelClient
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security
from gym_grpc.v1 import model_service_pb2 as model_pb


@click.command("samples")
@click.argument("path", metavar="ROLLOUTS.jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the samples: Parquet when it ends with .parquet, else JSONL.",
)
@click.option("--layout", type=click.Choice(training.LAYOUTS), default="verl", show_default=True)
@click.option(
    "--non-monotonic",
    type=click.Choice(["split", "refuse"]),
    default="split",
    show_default=True,
    help="A turn whose prompt does not extend the earlier ids: start a new sample, or stop with an error.",
)
@click.option(
    "--advantage",
    type=click.Choice(["std", "none"]),
    default="std",
    show_default=True,
    help="GRPO's (reward - group mean) / group std, or without the division (Dr. GRPO).",
)
@click.option(
    "--current-version",
    type=click.IntRange(min=0),
    help="The trainer's policy version now: each sample's lag is counted from it.",
)
@click.option(
    "--max-lag",
    type=click.IntRange(min=0),
    help="With --current-version: a sample whose oldest turn is further behind is stale.",
)
@click.option(
    "--stale",
    type=click.Choice(["mask", "drop"]),
    default="mask",
    show_default=True,
    help="A stale sample: kept with no loss, or left out.",
)
def samples_command(
    path: Path,
    output: Path,
    layout: training.Layout,
    non_monotonic: str,
    advantage: str,
    current_version: int | None,
    max_lag: int | None,
    stale: str,
) -> None:
    """Training samples from a rollouts file: per rollout one token sequence with its loss mask and log-probs,
    GRPO advantages per task, failed rollouts (from the failures sidecar) as masked members of their group."""
    if max_lag is not None and current_version is None:
        raise click.UsageError("--max-lag needs --current-version (the version the lag is counted from)")
    samples, stats = training.build(
        training.read_rollouts(path),
        non_monotonic=non_monotonic,  # type: ignore[arg-type]
        current_version=current_version,
        max_lag=max_lag,
        stale=stale,  # type: ignore[arg-type]
    )
    groups = training.assign_advantages(samples, scale=advantage)  # type: ignore[arg-type]
    training.write(samples, layout, output)
    flat = sum(1 for group in groups if group.rollouts > group.failed and group.std == 0)
    click.echo(stats.line(), err=True)
    click.echo(f"{len(groups):,} groups, {flat:,} of them with one reward for all (advantage 0) -> {output}", err=True)


@click.command("set-policy-version")
@click.argument("model_server", metavar="MODEL_SERVER")
@click.argument("version", type=click.IntRange(min=0, max=2**32 - 1))
@registry_option
@security_options
def set_policy_version_command(model_server: str, version: int, registry: str, security: Security) -> None:
    """Tell MODEL_SERVER (every replica and worker) that its engine now serves policy VERSION: the turns
    it generates from now on are stamped with it (for async training; see docs/training.md)."""

    async def tell(reg: Registry) -> None:
        await ModelClient(reg, model_server).set_policy_version(version)

    asyncio.run(with_registry(registry, model_server, tell, security))
    click.echo(f"{model_server} serves policy version {version}", err=True)


@click.command("update-weights")
@click.argument("model_server", metavar="MODEL_SERVER")
@click.argument("version", type=click.IntRange(min=0, max=2**32 - 1))
@click.option(
    "--checkpoint",
    required=True,
    help="checkpoint directory every engine can read (config.json and *.safetensors)",
)
@click.option(
    "--pause-mode",
    type=click.Choice(sorted(PAUSE_MODES)),
    default="keep",
    show_default=True,
    help="what becomes of the generations in flight: keep (frozen, then continued under the new weights), "
    "abort (generated again under them), wait (finished first)",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=UPDATE_TIMEOUT,
    show_default=True,
    help="seconds each replica may take",
)
@registry_option
@security_options
def update_weights_command(
    model_server: str, version: int, checkpoint: str, pause_mode: str, timeout: float, registry: str, security: Security
) -> None:
    """Have MODEL_SERVER (every replica) load the weights in CHECKPOINT into its engines and serve them as
    policy VERSION, pausing its engines meanwhile (ModelService.UpdateWeights; see docs/training.md)."""

    async def update(reg: Registry) -> list[model_pb.UpdateWeightsResponse]:
        return await ModelClient(reg, model_server).update_weights(version, checkpoint, pause_mode, timeout)

    answers = asyncio.run(with_registry(registry, model_server, update, security))
    for answer in answers:
        if not answer.updated:
            click.echo(f"{model_server} already serves policy version {version}: nothing done", err=True)
            continue
        engines = ", ".join(
            f"{e.engine} (paused {e.pause_seconds:.2f} s, loaded in {e.load_seconds:.2f} s)" for e in answer.engines
        )
        click.echo(f"{model_server} serves policy version {version} after {answer.seconds:.2f} s: {engines}", err=True)
