"""Task files in an MLflow model registry: an `mlflow server`, or GitLab's registry, which speaks its API.

A dataset is a registered model; each upload is a new model version whose
files (`artifact_fpath`, such as `train.jsonl`) are the artifacts of the run
the version points to. A plain MLflow server numbers versions itself (1, 2,
...); GitLab takes the version from the `gitlab.version` tag (`0.0.1`), which
`--version` sets, and a plain server keeps as a label that finds the version
too. So a NeMo Gym config's `gitlab_identifier: {dataset_name, version,
artifact_fpath}` reads from either.

The server and the token come from env.yaml (`mlflow_tracking_uri`,
`mlflow_tracking_token`, NeMo Gym's names), else from the environment
(MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, which MLflow itself reads). The
token is sent as a bearer token and masked in every message raised here.
The client is the `mlflow` package (`pip install 'gym-grpc[mlflow]'`),
imported only when a command needs it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from gym_grpc import errors
from gym_grpc.launch.masking import MASK

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

EXTRA = "gym-grpc[mlflow]"
#: The experiment that holds the runs of uploaded versions (on a plain MLflow server).
EXPERIMENT = "gym-grpc-datasets"
#: The tag that gives a version its name on GitLab (and a label on a plain MLflow server).
VERSION_TAG = "gitlab.version"
#: The tag of the runs gym-grpc creates, so that `delete` removes them with their version.
RUN_TAG = "gym_grpc.dataset"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class MlflowError(errors.FrameworkError):
    """The MLflow server refused or failed; the message names the dataset and never holds the token."""

    reason = errors.Reason.MLFLOW_FAILED


@dataclass(frozen=True)
class MlflowSettings:
    """Which MLflow server, and the token for it."""

    tracking_uri: str | None = None
    token: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, Any], environ: dict[str, str] | None = None) -> MlflowSettings:
        """env.yaml's `mlflow_tracking_uri` and `mlflow_tracking_token`, each else its MLFLOW_ variable."""
        environ = dict(os.environ) if environ is None else environ

        def text(key: str) -> str | None:
            value = env.get(key)
            if value in (None, ""):
                value = environ.get(key.upper())
            return str(value) if value not in (None, "") else None

        return cls(tracking_uri=text("mlflow_tracking_uri"), token=text("mlflow_tracking_token"))

    def mask(self, text: str) -> str:
        return text.replace(self.token, MASK) if self.token else text


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise MlflowError(f"dataset name {name!r}: use letters, digits, '.', '_' and '-' (not first)")
    return name


def check_artifact_fpath(artifact_fpath: str) -> PurePosixPath:
    path = PurePosixPath(artifact_fpath)
    if not artifact_fpath or path.is_absolute() or ".." in path.parts or not path.name:
        raise MlflowError(f"artifact path {artifact_fpath!r}: give a relative path such as train.jsonl")
    return path


def client(settings: MlflowSettings) -> MlflowClient:
    """An MlflowClient for the configured server; a clear error without the package or a server."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise MlflowError(
            f"the MLflow registry needs the mlflow client: pip install '{EXTRA}' (or mlflow-skinny)"
        ) from None
    if not settings.tracking_uri:
        raise MlflowError(
            "no MLflow server: set MLFLOW_TRACKING_URI, or mlflow_tracking_uri in env.yaml "
            "(GitLab's is <gitlab>/api/v4/projects/<project id>/ml/mlflow)"
        )
    if settings.token:
        # MLflow reads the token from here only; this process is the CLI's own.
        os.environ["MLFLOW_TRACKING_TOKEN"] = settings.token
    return MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)


def _failure(settings: MlflowSettings, what: str, error: Exception) -> MlflowError:
    return MlflowError(settings.mask(f"{what}: {type(error).__name__}: {error}"))


def _code(error: Exception) -> str | None:
    return getattr(error, "error_code", None)


def label(version: ModelVersion) -> str:
    """A version as a user names it: its number, and the label it was uploaded with."""
    tag = version.tags.get(VERSION_TAG) if version.tags else None
    return f"{version.version} ({tag})" if tag and tag != version.version else str(version.version)


def _order(version: ModelVersion) -> tuple[int, int]:
    number = int(version.version) if str(version.version).isdigit() else -1
    return (version.creation_timestamp or 0, number)


def versions(mlflow: MlflowClient, name: str) -> list[ModelVersion]:
    """Every version of a dataset, oldest first."""
    return sorted(mlflow.search_model_versions(f"name = '{name}'"), key=_order)


def _datasets(mlflow: MlflowClient) -> str:
    names = sorted(m.name for m in mlflow.search_registered_models(max_results=100))
    return f"datasets there: {', '.join(names)}" if names else "the registry holds no datasets"


def _missing_dataset(mlflow: MlflowClient, name: str, settings: MlflowSettings) -> MlflowError:
    return MlflowError(f"no dataset {name!r} at {settings.tracking_uri}; {_datasets(mlflow)}")


def _require_dataset(mlflow: MlflowClient, name: str, settings: MlflowSettings) -> None:
    """MlflowError naming the datasets there are when `name` is none of them."""
    from mlflow.exceptions import MlflowException

    try:
        mlflow.get_registered_model(name)
    except MlflowException as e:
        if _code(e) != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise _missing_dataset(mlflow, name, settings) from None


def resolve(mlflow: MlflowClient, name: str, version: str | None, settings: MlflowSettings) -> ModelVersion:
    """The version of a dataset that `version` names (a number or an uploaded label), or its latest."""
    from mlflow.exceptions import MlflowException

    if version is not None:
        try:  # GitLab names versions by their label: ask for it as is first
            return mlflow.get_model_version(name, version)
        except MlflowException as e:
            if _code(e) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
    found = versions(mlflow, name)
    if not found:
        _require_dataset(mlflow, name, settings)
        raise MlflowError(f"dataset {name!r} has no versions")
    if version is None:
        return found[-1]
    for candidate in found:
        if candidate.version == version or (candidate.tags or {}).get(VERSION_TAG) == version:
            return candidate
    listed = ", ".join(label(v) for v in found)
    raise MlflowError(f"dataset {name!r} has no version {version!r}; its versions: {listed}")


def _files(mlflow: MlflowClient, run_id: str, directory: str = "") -> list[str]:
    found = []
    for item in mlflow.list_artifacts(run_id, directory or None):
        found += _files(mlflow, run_id, item.path) if item.is_dir else [item.path]
    return found


@dataclass(frozen=True)
class Uploaded:
    """Where an upload landed."""

    name: str
    version: str
    artifact_fpath: str
    #: A file added to a version that existed (one with the --version label given).
    added: bool = False


def _log(mlflow: MlflowClient, run_id: str, path: Path, artifact_fpath: PurePosixPath) -> None:
    """Log `path` as `artifact_fpath` in the run (log_artifact keeps a file's own name: copy it first)."""
    with tempfile.TemporaryDirectory(prefix="gym-grpc-upload-") as directory:
        named = Path(directory) / artifact_fpath.name
        shutil.copyfile(path, named)
        parent = str(artifact_fpath.parent)
        mlflow.log_artifact(run_id, str(named), artifact_path=None if parent == "." else parent)


def _new_run(mlflow: MlflowClient, name: str) -> str:
    experiment = mlflow.get_experiment_by_name(EXPERIMENT)
    experiment_id = experiment.experiment_id if experiment else mlflow.create_experiment(EXPERIMENT)
    return mlflow.create_run(experiment_id, run_name=name, tags={RUN_TAG: name}).info.run_id


def _labelled(mlflow: MlflowClient, name: str, version: str) -> ModelVersion | None:
    """The version of a dataset labelled `version` at upload, if any (GitLab: the version so named)."""
    from mlflow.exceptions import MlflowException

    try:  # GitLab names versions by their label, so ask for it as is first
        found = mlflow.get_model_version(name, version)
    except MlflowException as e:
        if _code(e) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        labelled = [v for v in versions(mlflow, name) if (v.tags or {}).get(VERSION_TAG) == version]
        return labelled[-1] if labelled else None
    # a plain MLflow server numbers its versions: a label must not be taken for one of them
    if version.isdigit() and (found.tags or {}).get(VERSION_TAG) != version:
        raise MlflowError(
            f"dataset {name!r} already has a version {version} (with no such label): "
            "give a label that is not one of its version numbers"
        )
    return found


def upload(
    path: Path,
    name: str,
    artifact_fpath: str,
    settings: MlflowSettings,
    *,
    version: str | None = None,
    description: str | None = None,
) -> Uploaded:
    """Upload `path` as a new version of dataset `name` (created if needed).

    With `version`, the new version is labelled so (GitLab's version name); a
    version already labelled so gets the file added, unless it has that file."""
    from mlflow.exceptions import MlflowException

    check_name(name)
    in_registry = check_artifact_fpath(artifact_fpath)
    mlflow = client(settings)
    try:
        try:
            mlflow.create_registered_model(name)
        except MlflowException as e:
            if _code(e) != "RESOURCE_ALREADY_EXISTS":
                raise
        target = _labelled(mlflow, name, version) if version is not None else None
        if target is not None and target.run_id:
            files = _files(mlflow, target.run_id)
            if str(in_registry) in files:
                raise MlflowError(
                    f"version {label(target)} of dataset {name!r} already has {in_registry}: a version's "
                    "files are never replaced; upload without --version (or with a new one) for a new version"
                )
            _log(mlflow, target.run_id, path, in_registry)
            return Uploaded(name, label(target), str(in_registry), added=True)
        run_id = _new_run(mlflow, name)
        _log(mlflow, run_id, path, in_registry)
        mlflow.update_run(run_id, status="FINISHED")
        created = mlflow.create_model_version(
            name,
            source=mlflow.get_run(run_id).info.artifact_uri,
            run_id=run_id,
            tags={VERSION_TAG: version} if version is not None else None,
            description=description,
        )
        if created.run_id and created.run_id != run_id:
            # GitLab makes a run (its "candidate") of its own for each version: the files go there.
            _log(mlflow, created.run_id, path, in_registry)
    except MlflowError:
        raise
    except Exception as e:  # MLflow raises REST, HTTP and OS errors alike
        raise _failure(settings, f"uploading {path} to dataset {name!r}", e) from None
    return Uploaded(name, label(created), str(in_registry))


def download(
    name: str, version: str | None, artifact_fpath: str, destination: Path, settings: MlflowSettings
) -> tuple[str, Path]:
    """Download one file of a version (the latest without `version`) to `destination`; the version's label."""
    check_name(name)
    in_registry = check_artifact_fpath(artifact_fpath)
    mlflow = client(settings)
    try:
        found = resolve(mlflow, name, version, settings)
        if not found.run_id:
            raise MlflowError(f"version {label(found)} of dataset {name!r} has no run, so no files")
        files = _files(mlflow, found.run_id)
        if str(in_registry) not in files:
            raise MlflowError(
                f"version {label(found)} of dataset {name!r} has no file {in_registry}; "
                f"its files: {', '.join(files) or 'none'}"
            )
        with tempfile.TemporaryDirectory(prefix="gym-grpc-download-") as directory:
            local = mlflow.download_artifacts(found.run_id, str(in_registry), directory)
            destination.parent.mkdir(parents=True, exist_ok=True)
            temporary = destination.with_name(f".{destination.name}.tmp")
            shutil.copyfile(local, temporary)
            temporary.replace(destination)
    except MlflowError:
        raise
    except Exception as e:
        raise _failure(settings, f"downloading {in_registry} of dataset {name!r}", e) from None
    return label(found), destination


@dataclass(frozen=True)
class Deletion:
    """What `delete` will remove: a dataset's versions (all of them, or one)."""

    name: str
    versions: list[ModelVersion]
    whole: bool

    def __str__(self) -> str:
        listed = ", ".join(label(v) for v in self.versions) or "none"
        if self.whole:
            return f"dataset {self.name!r} with all its versions ({listed})"
        return f"version {listed} of dataset {self.name!r}"


def to_delete(name: str, version: str | None, settings: MlflowSettings) -> Deletion:
    """What deleting a dataset (or one of its versions) would remove; an error naming it if it does not exist."""

    check_name(name)
    mlflow = client(settings)
    try:
        if version is not None:
            return Deletion(name, [resolve(mlflow, name, version, settings)], whole=False)
        _require_dataset(mlflow, name, settings)
        return Deletion(name, versions(mlflow, name), whole=True)
    except MlflowError:
        raise
    except Exception as e:
        raise _failure(settings, f"looking up dataset {name!r}", e) from None


def delete(deletion: Deletion, settings: MlflowSettings) -> None:
    """Delete what `to_delete` found, with the runs gym-grpc created for its versions."""
    mlflow = client(settings)
    try:
        runs = [v.run_id for v in deletion.versions if v.run_id]
        if deletion.whole:
            mlflow.delete_registered_model(deletion.name)
        else:
            mlflow.delete_model_version(deletion.name, deletion.versions[0].version)
        for run_id in runs:
            if mlflow.get_run(run_id).data.tags.get(RUN_TAG) == deletion.name:
                mlflow.delete_run(run_id)
    except Exception as e:
        raise _failure(settings, f"deleting {deletion}", e) from None
