"""`gym-grpc dataset upload/download` and `prepare-data --download`, with the real
huggingface_hub client talking to a local fake of the Hub (tests/fake_hub.py)."""

import json
import os
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from tests.support import gym, read_rows

TOKEN = "hf_fake_secret_token_123"
MATH_TRAIN = Path(__file__).resolve().parent.parent / "servers" / "resources" / "math" / "data" / "train.jsonl"


@pytest.fixture
def hub():
    fake = FakeHub(TOKEN).start()
    yield fake
    fake.stop()


@pytest.fixture
def author(tmp_path, hub):
    """A working directory whose env.yaml holds the Hub credentials, and the environment the CLI runs in."""
    (tmp_path / "env.yaml").write_text(f"hf_token: {TOKEN}\nhf_organization: my-org\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    return tmp_path, env


def _dataset(author, *args: str):
    cwd, env = author
    done = gym("dataset", *args, cwd=cwd, env=env)
    assert TOKEN not in done.stdout + done.stderr, "the token was printed"
    return done


@pytest.mark.slow
def test_a_split_is_uploaded_to_a_named_private_repository_and_downloaded_back(author, hub, tmp_path):
    done = _dataset(
        author,
        "upload",
        str(MATH_TRAIN),
        "--domain",
        "math",
        "--name",
        "arithmetic",
        "--split",
        "train",
        "--message",
        "First arithmetic set",
        "--description",
        "64 generated tasks",
    )
    assert done.returncode == 0, done.stderr
    assert "uploaded" in done.stdout and "my-org/gym-math-arithmetic:train.jsonl" in done.stdout
    assert "64 rows, all tasks" in done.stderr
    repo = hub.repos["my-org/gym-math-arithmetic"]
    assert repo.private
    assert repo.files["main"]["train.jsonl"] == MATH_TRAIN.read_bytes()
    assert repo.commits == [
        {
            "revision": "main",
            "summary": "First arithmetic set",
            "description": "64 generated tasks",
            "files": ["train.jsonl"],
        }
    ]

    output = tmp_path / "back" / "train.jsonl"
    done = _dataset(
        author, "download", "--repo-id", "my-org/gym-math-arithmetic", "--split", "train", "--output", str(output)
    )
    assert done.returncode == 0, done.stderr
    assert output.read_bytes() == MATH_TRAIN.read_bytes()


@pytest.mark.slow
def test_create_pr_opens_a_pull_request_and_a_revision_downloads_from_it(author, hub, tmp_path):
    raw = tmp_path / "notes.md"
    raw.write_text("how the tasks were made\n")
    first = _dataset(author, "upload", str(raw), "--repo-id", "my-org/gym-math-notes")
    assert first.returncode == 0, first.stderr
    raw.write_text("how the tasks were made, revised\n")
    done = _dataset(author, "upload", str(raw), "--repo-id", "my-org/gym-math-notes", "--create-pr")
    assert done.returncode == 0, done.stderr
    assert "pull request: " in done.stdout and "/discussions/1" in done.stdout
    repo = hub.repos["my-org/gym-math-notes"]
    assert repo.files["main"]["notes.md"] == b"how the tasks were made\n"  # main is untouched
    assert repo.files["refs/pr/1"]["notes.md"] == b"how the tasks were made, revised\n"
    assert repo.commits[-1]["summary"] == "Upload notes.md with gym-grpc"

    output = tmp_path / "notes-pr.md"
    args = ["--repo-id", "my-org/gym-math-notes", "--artifact-fpath", "notes.md", "--revision", "refs/pr/1"]
    done = _dataset(author, "download", *args, "--output", str(output))
    assert done.returncode == 0, done.stderr
    assert output.read_text() == "how the tasks were made, revised\n"


def test_a_train_split_with_malformed_rows_is_refused_before_anything_is_sent(author, hub, tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(MATH_TRAIN.read_text().splitlines()[0] + "\n" + '{"expected_answer": "4"}\n{"oops"\n')
    done = _dataset(author, "upload", str(bad), "--domain", "math", "--name", "broken", "--split", "train")
    assert done.returncode == 1
    assert "2 malformed row(s); nothing was uploaded" in done.stderr
    assert f"{bad}:2: responses_create_params: is required" in done.stderr
    assert f"{bad}:3: not JSON" in done.stderr
    assert not [r for r in hub.requests if r.startswith("POST")]


def test_a_wrong_token_is_refused_and_never_printed(author, hub):
    cwd, env = author
    hub.token = "the-real-token"
    done = _dataset(author, "upload", str(MATH_TRAIN), "--domain", "math", "--name", "x", "--split", "train")
    assert done.returncode == 1
    assert "401" in done.stderr and "***" in done.stderr  # the fake echoed the header; it was masked


def test_a_missing_file_is_a_clear_error(author, hub, tmp_path):
    assert _dataset(author, "upload", str(MATH_TRAIN), "--repo-id", "my-org/gym-math-x").returncode == 0
    done = _dataset(
        author,
        "download",
        "--repo-id",
        "my-org/gym-math-x",
        "--split",
        "validation",
        "--output",
        str(tmp_path / "v.jsonl"),
    )
    assert done.returncode == 1
    assert "downloading validation.jsonl of my-org/gym-math-x" in done.stderr
    assert not (tmp_path / "v.jsonl").exists()


def test_naming_needs_an_organization_a_domain_and_a_name(author):
    cwd, env = author
    (cwd / "env.yaml").write_text(f"hf_token: {TOKEN}\n")
    done = _dataset(author, "upload", str(MATH_TRAIN), "--domain", "math")
    assert done.returncode == 2 and "give --repo-id, or --organization, --name" in done.stderr
    done = _dataset(author, "upload", str(MATH_TRAIN), "--organization", "o", "--domain", "ma th", "--name", "n")
    assert done.returncode == 2 and "domain 'ma th'" in done.stderr


@pytest.mark.slow
def test_prepare_data_downloads_missing_training_data_from_the_hub(author, hub):
    cwd, env = author
    assert (
        _dataset(
            author, "upload", str(MATH_TRAIN), "--repo-id", "my-org/gym-math-arithmetic", "--split", "train"
        ).returncode
        == 0
    )
    spec = {
        "name": "arithmetic",
        "type": "train",
        "jsonl_fpath": "data/train.jsonl",
        "license": "Apache-2.0",
        "huggingface_identifier": {"repo_id": "my-org/gym-math-arithmetic", "artifact_fpath": "train.jsonl"},
    }
    (cwd / "config.yaml").write_text(
        json.dumps({"servers": {"math_agent": {"entrypoint": "a.py:A", "datasets": [spec]}}})
    )
    without = gym("prepare-data", "config.yaml", "--mode", "train-preparation", cwd=cwd, env=env)
    assert without.returncode == 1 and "pass --download to fetch it from the Hub" in without.stderr

    done = gym("prepare-data", "config.yaml", "--mode", "train-preparation", "--download", cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr
    assert (cwd / "data" / "train.jsonl").read_bytes() == MATH_TRAIN.read_bytes()
    assert len(read_rows(cwd / "prepared_data" / "train.jsonl")) == 64
    assert TOKEN not in done.stdout + done.stderr
