"""Task files on the Hugging Face Hub, through `huggingface_hub`.

A dataset repository is named `{organization}/{prefix}-{domain}-{name}`
(`my-org/gym-math-competition`); a split is the file `{split}.jsonl` in it,
and any other file (`artifact_fpath`) can be uploaded or downloaded as is.

Credentials come from env.yaml (`hf_token`; `hf_organization` and
`hf_endpoint` too), else from huggingface_hub's own sources (HF_TOKEN, a
saved login). The token is sent only to the Hub and never printed: it is
masked in every message this module raises.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from gym_grpc import errors
from gym_grpc.launch.config import DatasetType
from gym_grpc.launch.masking import MASK

SPLITS: tuple[str, ...] = get_args(DatasetType)
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(errors.FrameworkError):
    """The Hub refused or failed; the message names what and never holds the token."""

    reason = errors.Reason.HUB_FAILED


@dataclass(frozen=True)
class HubSettings:
    """Who we are on the Hub, and which Hub."""

    token: str | None = None
    endpoint: str | None = None
    organization: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, Any]) -> HubSettings:
        """Settings from the variables of env.yaml (`hf_token`, `hf_endpoint`, `hf_organization`)."""

        def text(key: str) -> str | None:
            value = env.get(key)
            return str(value) if value not in (None, "") else None

        return cls(token=text("hf_token"), endpoint=text("hf_endpoint"), organization=text("hf_organization"))

    def mask(self, text: str) -> str:
        return text.replace(self.token, MASK) if self.token else text


def repo_name(organization: str, prefix: str, domain: str, name: str) -> str:
    """`{organization}/{prefix}-{domain}-{name}`, each part checked."""
    for what, value in (("organization", organization), ("prefix", prefix), ("domain", domain), ("name", name)):
        if not _PART.match(value):
            raise HubError(f"{what} {value!r}: use letters, digits, '.', '_' and '-' (not first)")
    return f"{organization}/{prefix}-{domain}-{name}"


def split_file(split: str) -> str:
    """The file in the repository that holds a split."""
    if split not in SPLITS:
        raise HubError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    return f"{split}.jsonl"


@dataclass(frozen=True)
class Uploaded:
    """Where an upload landed."""

    repo_id: str
    path_in_repo: str
    commit_url: str
    #: The pull request opened, with --create-pr.
    pr_url: str | None = None


def _failure(settings: HubSettings, what: str, error: Exception) -> HubError:
    return HubError(settings.mask(f"{what}: {type(error).__name__}: {error}"))


def upload(
    path: Path,
    repo_id: str,
    path_in_repo: str,
    settings: HubSettings,
    *,
    message: str | None = None,
    description: str | None = None,
    create_pr: bool = False,
    revision: str | None = None,
    private: bool = True,
) -> Uploaded:
    """Create the dataset repository if needed and commit one file to it."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=settings.endpoint, token=settings.token)
    try:
        api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
        info = api.upload_file(
            path_or_fileobj=str(path),
            path_in_repo=path_in_repo,
            repo_id=repo_id,
            repo_type="dataset",
            revision=revision,
            commit_message=message or f"Upload {path_in_repo} with gym-grpc",
            commit_description=description,
            create_pr=create_pr,
        )
    except Exception as e:  # huggingface_hub raises HTTP, validation and OS errors alike
        raise _failure(settings, f"uploading {path} to {repo_id}", e) from None
    return Uploaded(repo_id, path_in_repo, str(info.commit_url), str(info.pr_url) if info.pr_url else None)


def download(
    repo_id: str, filename: str, destination: Path, settings: HubSettings, *, revision: str | None = None
) -> Path:
    """Download one file of a dataset repository to `destination` (through the Hub cache)."""
    from huggingface_hub import hf_hub_download

    try:
        cached = hf_hub_download(
            repo_id,
            filename,
            repo_type="dataset",
            revision=revision,
            token=settings.token,
            endpoint=settings.endpoint,
        )
    except Exception as e:
        raise _failure(settings, f"downloading {filename} of {repo_id}", e) from None
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.with_name(f".{destination.name}.tmp")
    shutil.copyfile(cached, temporary)
    temporary.replace(destination)
    return destination
