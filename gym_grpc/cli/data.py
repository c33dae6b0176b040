"""`gym-grpc prepare-data` and `gym-grpc dataset upload|download|delete`: task files, checked and shared."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from gym_grpc.cli.options import env_file_option, given, no_unknown_options, split_args
from gym_grpc.datasets import hub, mlflow_store
from gym_grpc.datasets.prepare import MODE_SPELLINGS, MODES, Dataset, prepare, read_tasks
from gym_grpc.launch.config import load_config, load_env


def _hub_settings(env_file: Path | None) -> hub.HubSettings:
    return hub.HubSettings.from_env(load_env(env_file))


def _mlflow_settings(env_file: Path | None) -> mlflow_store.MlflowSettings:
    return mlflow_store.MlflowSettings.from_env(load_env(env_file))


#: Where datasets are kept: the Hub, or an MLflow server (NeMo Gym's `gitlab` is one).
_STORES = {"hf": "hf", "huggingface": "hf", "mlflow": "mlflow", "gitlab": "mlflow"}
#: NeMo Gym's `data_source` values and ours, for prepare-data --data-source.
_DATA_SOURCES = {"huggingface": "huggingface", "hf": "huggingface", "mlflow": "mlflow", "gitlab": "mlflow"}


def _only_for(ctx: click.Context, store: str, others: tuple[str, ...]) -> None:
    """Refuse the options of the other store: a Hub option with --to mlflow is a mistake, not a no-op."""
    wrong = given(ctx, others)
    if wrong:
        raise click.UsageError(f"{', '.join(wrong)}: not an option for {store}")


@click.command("prepare-data", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="CONFIG... [KEY=VALUE]...", callback=no_unknown_options)
@click.option(
    "--mode",
    type=click.Choice([*MODES, *MODE_SPELLINGS]),
    required=True,
    callback=lambda ctx, param, value: MODE_SPELLINGS.get(value, value),
    help="Which datasets: example, or train and validation (NeMo Gym's example_validation and "
    "train_preparation work too).",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("prepared_data"),
    show_default=True,
    help="Where the collated <type>.jsonl files are written.",
)
@click.option("--update-stats", is_flag=True, help="Accept changed data: rewrite its statistics files.")
@click.option(
    "--download",
    "--should-download",
    "download",
    is_flag=True,
    help="Fetch missing files from their huggingface_identifier or mlflow_identifier.",
)
@click.option(
    "--generate",
    is_flag=True,
    help="Write the datasets that are generated_by a server with that server's task_rows() first.",
)
@click.option(
    "--data-source",
    type=click.Choice(list(_DATA_SOURCES)),
    callback=lambda ctx, param, value: _DATA_SOURCES.get(value, value),
    help="With --download, the source of a dataset that has both identifiers.  [default: huggingface]",
)
@env_file_option
def prepare_data_command(
    args: tuple[str, ...],
    mode: str,
    output_dir: Path,
    update_stats: bool,
    download: bool,
    generate: bool,
    data_source: str | None,
    env_file: Path | None,
) -> None:
    """Check, measure and collate the datasets that CONFIG files list on their agents.

    Every malformed row is reported (file, line, field) before anything is
    written; statistics are kept in <data>.stats.json next to each file and a
    change to them is an error; the rows are collated into one JSONL per type
    in --output-dir, each with an agent_ref and repeated num_repeats times.
    A dataset is listed as `datasets: [{name, type: train|validation|example,
    jsonl_fpath, license, num_repeats, huggingface_identifier: {repo_id,
    artifact_fpath}, mlflow_identifier: {dataset_name, version,
    artifact_fpath}, generated_by: {server, limit}}]` on a server of the
    config (NeMo Gym's gitlab_identifier is an mlflow_identifier). With
    --generate, a dataset generated_by a resources server (reasoning-gym,
    TextArena) is first written by that server from its configuration."""
    if data_source and not download:
        raise click.UsageError("--data-source chooses where --download fetches from: give --download too")
    files, overrides = split_args(args)
    settings = _hub_settings(env_file)
    mlflow_settings = _mlflow_settings(env_file)

    def fetch(dataset: Dataset) -> Path:
        source = (data_source or "huggingface") if len(dataset.sources) > 1 else dataset.sources[0]
        if source == "mlflow":
            held = dataset.spec.mlflow_identifier
            assert held is not None
            version, path = mlflow_store.download(
                held.dataset_name, held.version, held.artifact_fpath, dataset.path, mlflow_settings
            )
            click.echo(f"  from dataset {held.dataset_name!r} version {version}", err=True)
            return path
        where = dataset.spec.huggingface_identifier
        assert where is not None
        return hub.download(where.repo_id, where.artifact_fpath, dataset.path, settings, revision=where.revision)

    config = load_config(files, overrides, env_file=env_file)
    done = prepare(
        config,
        mode,  # type: ignore[arg-type]
        output_dir,
        update_stats=update_stats,
        fetch=fetch if download else None,
        generate=generate,
        echo=lambda line: click.echo(line, err=True),
    )
    for path in done.stats_written:
        click.echo(f"wrote statistics {path} (commit it)")
    for kind, (path, count) in done.outputs.items():
        click.echo(f"{kind}: {count} rows in {path}")


@click.group()
def dataset() -> None:
    """Upload task files to the Hugging Face Hub or an MLflow server, download them, delete them."""


#: The options of each store, refused with the other (`--to`/`--from` chooses).
_HUB_OPTIONS = ("repo_id", "organization", "prefix", "domain", "name", "revision")
_HUB_UPLOAD_OPTIONS = ("create_pr", "message", "public")
_MLFLOW_OPTIONS = ("dataset_name", "version")


def _store_option(flag: str, verb: str) -> Callable:
    return click.option(
        flag,
        "store",
        type=click.Choice(list(_STORES)),
        default="hf",
        show_default=True,
        callback=lambda ctx, param, value: _STORES[value],
        help=f"Where to {verb}: the Hugging Face Hub, or an MLflow server (an `mlflow server`, or GitLab's; "
        "`gitlab` is taken too).",
    )


def _repo_options(command: Callable) -> Callable:
    options = [
        click.option("--repo-id", help="Hub: the dataset repository, instead of the four parts below."),
        click.option("--organization", help="Hub organization.  [default: env.yaml hf_organization]"),
        click.option("--prefix", default="gym", show_default=True, help="Hub: first part of the repository name."),
        click.option("--domain", help="Hub: second part, the domain (math, coding, agent, ...)."),
        click.option("--name", help="Hub: last part, the dataset's name."),
        click.option("--revision", help="Hub: branch, tag or PR ref (refs/pr/N).  [default: main]"),
        env_file_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command


_dataset_name_option = click.option(
    "--dataset-name", help="MLflow: the dataset (a registered model; NeMo Gym's dataset_name)."
)


def _repo_id(
    settings: hub.HubSettings,
    repo_id: str | None,
    organization: str | None,
    prefix: str,
    domain: str | None,
    name: str | None,
) -> str:
    if repo_id:
        return repo_id
    organization = organization or settings.organization
    missing = [o for o, v in (("--organization", organization), ("--domain", domain), ("--name", name)) if not v]
    if missing:
        raise click.UsageError(f"give --repo-id, or {', '.join(missing)}")
    try:
        return hub.repo_name(organization, prefix, domain, name)  # type: ignore[arg-type]
    except hub.HubError as e:
        raise click.UsageError(str(e)) from None


def _dataset_name(dataset_name: str | None) -> str:
    if not dataset_name:
        raise click.UsageError("give --dataset-name")
    try:
        return mlflow_store.check_name(dataset_name)
    except mlflow_store.MlflowError as e:
        raise click.UsageError(str(e)) from None


@dataset.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_store_option("--to", "upload")
@_repo_options
@_dataset_name_option
@click.option(
    "--version",
    help="MLflow: label the new version so (GitLab's version name, x.y.z); a version already labelled so "
    "gets the file added.  [default: the server numbers it]",
)
@click.option("--split", type=click.Choice(hub.SPLITS), help="Upload as <split>.jsonl, after checking every row.")
@click.option("--artifact-fpath", help="Path in the repository or version, for a raw file.  [default: its name]")
@click.option("--create-pr", is_flag=True, help="Hub: open a pull request instead of committing to the branch.")
@click.option("--message", help="Hub: commit message.")
@click.option("--description", help="Commit description (Hub), version description (MLflow).")
@click.option("--public", is_flag=True, help="Hub: create the repository public (it is private by default).")
@click.pass_context
def upload_command(
    ctx: click.Context,
    path: Path,
    store: str,
    repo_id: str | None,
    organization: str | None,
    prefix: str,
    domain: str | None,
    name: str | None,
    revision: str | None,
    env_file: Path | None,
    dataset_name: str | None,
    version: str | None,
    split: str | None,
    artifact_fpath: str | None,
    create_pr: bool,
    message: str | None,
    description: str | None,
    public: bool,
) -> None:
    """Upload PATH: a split (checked first) or a raw file, to a Hub repository or a new MLflow version."""
    if split and artifact_fpath:
        raise click.UsageError("give --split or --artifact-fpath, not both")
    if store == "mlflow":
        _only_for(ctx, "--to mlflow", (*_HUB_OPTIONS, *_HUB_UPLOAD_OPTIONS))
        checked_name = _dataset_name(dataset_name)
    else:
        _only_for(ctx, "--to hf", _MLFLOW_OPTIONS)
        settings = _hub_settings(env_file)
        repo = _repo_id(settings, repo_id, organization, prefix, domain, name)
    if split:
        checked = read_tasks(path)
        if checked.problems:
            lines = "\n".join(f"  {p}" for p in checked.problems)
            raise click.ClickException(f"{len(checked.problems)} malformed row(s); nothing was uploaded\n{lines}")
        click.echo(f"{path}: {len(checked.rows)} rows, all tasks", err=True)
    in_repo = hub.split_file(split) if split else (artifact_fpath or path.name)
    if store == "mlflow":
        landed = mlflow_store.upload(
            path, checked_name, in_repo, _mlflow_settings(env_file), version=version, description=description
        )
        verb = "added" if landed.added else "uploaded"
        click.echo(f"{verb} {path} to dataset {landed.name!r} version {landed.version}: {landed.artifact_fpath}")
        click.echo(
            f"  mlflow_identifier: {{dataset_name: {landed.name}, version: '{version or landed.version}', "
            f"artifact_fpath: {landed.artifact_fpath}}}"
        )
        return
    done = hub.upload(
        path,
        repo,
        in_repo,
        settings,
        message=message,
        description=description,
        create_pr=create_pr,
        revision=revision,
        private=not public,
    )
    click.echo(f"uploaded {path} to {done.repo_id}:{done.path_in_repo}  {done.commit_url}")
    if done.pr_url:
        click.echo(f"pull request: {done.pr_url}")


@dataset.command("download")
@_store_option("--from", "download from")
@_repo_options
@_dataset_name_option
@click.option("--version", help="MLflow: the version number or label.  [default: the latest]")
@click.option("--split", type=click.Choice(hub.SPLITS), help="Download <split>.jsonl.")
@click.option("--artifact-fpath", help="Download this file of the repository or version.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Where to write it.")
@click.pass_context
def download_command(
    ctx: click.Context,
    store: str,
    repo_id: str | None,
    organization: str | None,
    prefix: str,
    domain: str | None,
    name: str | None,
    revision: str | None,
    env_file: Path | None,
    dataset_name: str | None,
    version: str | None,
    split: str | None,
    artifact_fpath: str | None,
    output: Path,
) -> None:
    """Download a split or a raw file of a Hub repository or an MLflow version to --output."""
    if bool(split) == bool(artifact_fpath):
        raise click.UsageError("give --split or --artifact-fpath")
    filename = hub.split_file(split) if split else artifact_fpath
    assert filename is not None
    if store == "mlflow":
        _only_for(ctx, "--from mlflow", _HUB_OPTIONS)
        checked_name = _dataset_name(dataset_name)
        got, _ = mlflow_store.download(checked_name, version, filename, output, _mlflow_settings(env_file))
        click.echo(f"downloaded {filename} of dataset {checked_name!r} version {got} to {output}")
        return
    _only_for(ctx, "--from hf", _MLFLOW_OPTIONS)
    settings = _hub_settings(env_file)
    repo = _repo_id(settings, repo_id, organization, prefix, domain, name)
    hub.download(repo, filename, output, settings, revision=revision)
    click.echo(f"downloaded {repo}:{filename} to {output}")


@dataset.command("delete")
@click.option(
    "--from",
    "store",
    type=click.Choice(["mlflow", "gitlab"]),
    required=True,
    help="An MLflow server (an `mlflow server`, or GitLab's; `gitlab` is taken too).",
)
@_dataset_name_option
@click.option("--version", help="Delete only this version (number or label).  [default: the dataset, every version]")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (for scripts).")
@env_file_option
def delete_command(store: str, dataset_name: str | None, version: str | None, yes: bool, env_file: Path | None) -> None:
    """Delete a dataset from an MLflow server, or one of its versions, after a confirmation."""
    checked_name = _dataset_name(dataset_name)
    settings = _mlflow_settings(env_file)
    deletion = mlflow_store.to_delete(checked_name, version, settings)
    if not yes:
        try:
            agreed = click.confirm(f"delete {deletion} at {settings.tracking_uri}?", default=False, err=True)
        except click.Abort:  # no answer: stdin closed, as in a script
            agreed = False
        if not agreed:
            raise click.ClickException(f"nothing deleted: {deletion} was not confirmed (--yes skips the question)")
    mlflow_store.delete(deletion, settings)
    click.echo(f"deleted {deletion}")
