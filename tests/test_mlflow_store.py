"""`gym-grpc dataset upload/download/delete --to/--from mlflow` and `prepare-data --download`
from an `mlflow_identifier` (NeMo Gym's `gitlab_identifier`), against a real `mlflow server`
process started once for this module, and the real MLflow client."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from gym_grpc.cli.app import main
from gym_grpc.rpc import ports
from tests.support import gym, read_rows, tool

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parent.parent / "servers" / "resources" / "math" / "data"
TRAIN, VALIDATION = DATA / "train.jsonl", DATA / "validation.jsonl"
#: Quiet, offline MLflow: no usage reports, no job runner process beside the server.
QUIET = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `mlflow server` (sqlite backend, artifacts served by it), all its files in a tmp dir."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = ports.free_port()  # mlflow server cannot bind port 0 and report it
    url = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    process = subprocess.Popen(
        [
            tool("mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **QUIET},
        start_new_session=True,  # it starts uvicorn as a child: stop the whole group
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"mlflow server exited: {(root / 'server.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 180 s"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)  # not listening yet: poll again
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


@pytest.fixture
def author(tmp_path, server, monkeypatch):
    """The CLI's working directory and environment: the server in MLFLOW_TRACKING_URI, no token."""
    monkeypatch.chdir(tmp_path)
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    # the CLI sets it in-process from env.yaml: monkeypatch restores its absence after the test
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    return tmp_path


def _cli(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def _registry(server: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server, registry_uri=server)


def _name(request) -> str:
    """A dataset name of its own for each test (one server holds them all)."""
    return request.node.name.removeprefix("test_")[:60]


def test_each_upload_is_a_new_version_and_downloads_back_byte_for_byte(author, server, request):
    name = _name(request)
    first = _cli("dataset", "upload", str(TRAIN), "--to", "mlflow", "--dataset-name", name, "--split", "train")
    assert first.exit_code == 0, first.output
    assert "64 rows, all tasks" in first.stderr
    assert f"uploaded {TRAIN} to dataset {name!r} version 1: train.jsonl" in first.stdout
    smaller = author / "smaller.jsonl"
    smaller.write_bytes(b"".join(TRAIN.read_bytes().splitlines(keepends=True)[:5]))
    second = _cli("dataset", "upload", str(smaller), "--to", "mlflow", "--dataset-name", name, "--split", "train")
    assert second.exit_code == 0, second.output
    assert f"dataset {name!r} version 2: train.jsonl" in second.stdout
    assert len(second.stdout.splitlines()) == 2, second.stdout  # what happened and the identifier, no MLflow chatter

    versions = _registry(server).search_model_versions(f"name = '{name}'")
    assert sorted(v.version for v in versions) == ["1", "2"]

    latest = _cli(
        "dataset", "download", "--from", "mlflow", "--dataset-name", name, "--split", "train", "--output", "l.jsonl"
    )
    assert latest.exit_code == 0, latest.output
    assert "version 2 to l.jsonl" in latest.stdout
    assert (author / "l.jsonl").read_bytes() == smaller.read_bytes()
    old = _cli(
        "dataset", "download", "--from", "mlflow", "--dataset-name", name, "--version", "1",
        "--artifact-fpath", "train.jsonl", "--output", "deep/old.jsonl",
    )  # fmt: skip
    assert old.exit_code == 0, old.output
    assert (author / "deep" / "old.jsonl").read_bytes() == TRAIN.read_bytes()


def test_a_labelled_version_holds_several_files_as_nemo_gym_uploads_them(author, server, request):
    name = _name(request)
    said = []
    for path, split in ((TRAIN, "train"), (VALIDATION, "validation")):
        done = _cli(
            "dataset", "upload", str(path), "--to", "gitlab", "--dataset-name", name, "--version", "0.0.1",
            "--split", split,
        )  # fmt: skip
        assert done.exit_code == 0, done.output
        said.append(done.stdout)
    assert said[0].startswith(f"uploaded {TRAIN} to dataset {name!r} version 1 (0.0.1): train.jsonl")
    assert done.stdout.startswith(f"added {VALIDATION} to dataset {name!r} version 1 (0.0.1): validation.jsonl")
    assert f"mlflow_identifier: {{dataset_name: {name}, version: '0.0.1', artifact_fpath: validation.jsonl}}" in (
        done.stdout
    )
    again = _cli(
        "dataset", "upload", str(TRAIN), "--to", "mlflow", "--dataset-name", name, "--version", "0.0.1",
        "--split", "train",
    )  # fmt: skip
    assert again.exit_code == 1
    assert f"version 1 (0.0.1) of dataset {name!r} already has train.jsonl" in again.stderr
    number = _cli(
        "dataset", "upload", str(TRAIN), "--to", "mlflow", "--dataset-name", name, "--version", "1",
        "--split", "train",
    )  # fmt: skip
    assert number.exit_code == 1 and "already has a version 1 (with no such label)" in number.stderr

    for split, source in (("validation", VALIDATION), ("train", TRAIN)):
        done = _cli(
            "dataset", "download", "--from", "mlflow", "--dataset-name", name, "--version", "0.0.1",
            "--split", split, "--output", f"{split}.jsonl",
        )  # fmt: skip
        assert done.exit_code == 0, done.output
        assert (author / f"{split}.jsonl").read_bytes() == source.read_bytes()
    assert len(_registry(server).search_model_versions(f"name = '{name}'")) == 1


def test_missing_datasets_versions_and_files_are_errors_that_list_what_exists(author, request):
    name = _name(request)
    assert _cli("dataset", "upload", str(TRAIN), "--to", "mlflow", "--dataset-name", name).exit_code == 0

    def download(*args: str):
        return _cli("dataset", "download", "--from", "mlflow", *args, "--output", "out.jsonl")

    nothing = download("--dataset-name", f"{name}-typo", "--split", "train")
    assert nothing.exit_code == 1
    assert f"no dataset '{name}-typo' at http://127.0.0.1:" in nothing.stderr
    assert "datasets there: " in nothing.stderr and name in nothing.stderr
    no_version = download("--dataset-name", name, "--version", "7", "--artifact-fpath", "train.jsonl")
    assert no_version.exit_code == 1
    assert f"dataset {name!r} has no version '7'; its versions: 1" in no_version.stderr
    no_label = download("--dataset-name", name, "--version", "0.0.9", "--artifact-fpath", "train.jsonl")
    assert no_label.exit_code == 1 and "has no version '0.0.9'; its versions: 1" in no_label.stderr
    no_file = download("--dataset-name", name, "--split", "validation")
    assert no_file.exit_code == 1
    assert f"version 1 of dataset {name!r} has no file validation.jsonl; its files: train.jsonl" in no_file.stderr
    assert not (author / "out.jsonl").exists()
    gone = _cli("dataset", "delete", "--from", "mlflow", "--dataset-name", f"{name}-typo", "--yes")
    assert gone.exit_code == 1 and f"no dataset '{name}-typo'" in gone.stderr


def test_malformed_rows_are_refused_before_anything_is_sent(author, server, request):
    name = _name(request)
    bad = author / "train.jsonl"
    bad.write_text(TRAIN.read_text().splitlines()[0] + "\n" + '{"expected_answer": "4"}\n{"oops"\n')
    done = _cli("dataset", "upload", str(bad), "--to", "mlflow", "--dataset-name", name, "--split", "train")
    assert done.exit_code == 1
    assert "2 malformed row(s); nothing was uploaded" in done.stderr
    assert f"{bad}:2: responses_create_params: is required" in done.stderr
    assert f"{bad}:3: not JSON" in done.stderr
    assert _registry(server).search_registered_models(f"name = '{name}'") == []


def test_delete_asks_first_and_deletes_nothing_without_a_yes(author, server, request):
    name = _name(request)
    for _ in range(2):
        assert _cli("dataset", "upload", str(TRAIN), "--to", "mlflow", "--dataset-name", name).exit_code == 0
    registry = _registry(server)
    (first_run,) = [v.run_id for v in registry.search_model_versions(f"name = '{name}'") if v.version == "1"]

    # a script with no terminal: stdin is closed, nothing is answered
    closed = gym(
        "dataset", "delete", "--from", "mlflow", "--dataset-name", name, "--version", "1",
        cwd=author, env={**os.environ}, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert closed.returncode == 1
    assert f"nothing deleted: version 1 of dataset {name!r} was not confirmed (--yes skips" in closed.stderr
    refused = _cli("dataset", "delete", "--from", "mlflow", "--dataset-name", name, "--version", "1", input="n\n")
    assert refused.exit_code == 1 and "nothing deleted" in refused.stderr
    assert f"delete version 1 of dataset {name!r} at {server}? [y/N]" in refused.stderr
    assert sorted(v.version for v in registry.search_model_versions(f"name = '{name}'")) == ["1", "2"]

    agreed = _cli("dataset", "delete", "--from", "mlflow", "--dataset-name", name, "--version", "1", input="y\n")
    assert agreed.exit_code == 0, agreed.output
    assert f"deleted version 1 of dataset {name!r}" in agreed.stdout
    assert [v.version for v in registry.search_model_versions(f"name = '{name}'")] == ["2"]
    assert registry.get_run(first_run).info.lifecycle_stage == "deleted"  # its files go with it

    whole = _cli("dataset", "delete", "--from", "gitlab", "--dataset-name", name, "--yes")
    assert whole.exit_code == 0, whole.output
    assert f"deleted dataset {name!r} with all its versions (2)" in whole.stdout
    assert registry.search_registered_models(f"name = '{name}'") == []


def test_prepare_data_downloads_a_nemo_gym_config_unchanged(author, server, request):
    """NeMo Gym's spelling (gitlab_identifier, `--should-download --data-source gitlab`), the
    server from env.yaml only; a dataset with both identifiers takes the source asked for."""
    name = _name(request)
    upload = _cli(
        "dataset", "upload", str(TRAIN), "--to", "mlflow", "--dataset-name", name, "--version", "0.0.1",
        "--split", "train",
    )  # fmt: skip
    assert upload.exit_code == 0, upload.output
    assert _cli("dataset", "upload", str(VALIDATION), "--to", "mlflow", "--dataset-name", name).exit_code == 0

    def identifier(artifact: str, version: str | None) -> dict:
        return {"dataset_name": name, "artifact_fpath": artifact, **({"version": version} if version else {})}

    datasets = [
        {
            "name": "train",
            "type": "train",
            "jsonl_fpath": "data/train.jsonl",
            "license": "Apache 2.0",
            "gitlab_identifier": identifier("train.jsonl", "0.0.1"),
        },
        {
            "name": "validation",
            "type": "validation",
            "jsonl_fpath": "data/validation.jsonl",
            "license": "Apache 2.0",
            "gitlab_identifier": identifier("validation.jsonl", None),  # the latest: version 2
            "huggingface_identifier": {"repo_id": "nobody/none", "artifact_fpath": "validation.jsonl"},
        },
    ]
    (author / "config.yaml").write_text(
        json.dumps({"servers": {"math_agent": {"entrypoint": "a.py:A", "datasets": datasets}}})
    )
    (author / "env.yaml").write_text(f"mlflow_tracking_uri: {server}\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}

    without = gym("prepare-data", "config.yaml", "--mode", "train_preparation", cwd=author, env=env)
    assert without.returncode == 1
    assert "pass --download to fetch it from the MLflow registry" in without.stderr
    assert "pass --download to fetch it from the Hub or the MLflow registry" in without.stderr

    done = gym(
        "prepare-data", "config.yaml", "--mode", "train_preparation", "--should-download", "--data-source", "gitlab",
        cwd=author, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"from dataset {name!r} version 1 (0.0.1)" in done.stderr
    assert f"from dataset {name!r} version 2" in done.stderr
    assert (author / "data" / "train.jsonl").read_bytes() == TRAIN.read_bytes()
    assert (author / "data" / "validation.jsonl").read_bytes() == VALIDATION.read_bytes()
    assert len(read_rows(author / "prepared_data" / "train.jsonl")) == 64
    assert not list(author.glob("mlruns")) and not list(author.glob("mlflow.db"))


def test_store_options_are_checked(author):
    upload = ("dataset", "upload", str(TRAIN))
    wrong_store = _cli(*upload, "--to", "mlflow", "--dataset-name", "x", "--repo-id", "o/r", "--public")
    assert wrong_store.exit_code == 2 and "--repo-id, --public: not an option for --to mlflow" in wrong_store.stderr
    wrong_hub = _cli(*upload, "--repo-id", "o/r", "--version", "1")
    assert wrong_hub.exit_code == 2 and "--version: not an option for --to hf" in wrong_hub.stderr
    no_name = _cli(*upload, "--to", "mlflow")
    assert no_name.exit_code == 2 and "give --dataset-name" in no_name.stderr
    bad_name = _cli(*upload, "--to", "mlflow", "--dataset-name", "my data")
    assert bad_name.exit_code == 2 and "dataset name 'my data'" in bad_name.stderr
    typo = _cli(*upload, "--to", "mlfow", "--dataset-name", "x")
    assert typo.exit_code == 2 and "'mlfow' is not one of" in typo.stderr
    escape = _cli(*upload, "--to", "mlflow", "--dataset-name", "x", "--artifact-fpath", "../up.jsonl")
    assert escape.exit_code == 1 and "artifact path '../up.jsonl'" in escape.stderr
    no_delete_store = _cli("dataset", "delete", "--dataset-name", "x")
    assert no_delete_store.exit_code == 2 and "Missing option '--from'" in no_delete_store.stderr
    alone = _cli("prepare-data", "c.yaml", "--mode", "example-validation", "--data-source", "mlflow")
    assert alone.exit_code == 2 and "give --download too" in alone.stderr


def test_no_server_configured_is_a_clear_error(author, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    done = _cli("dataset", "download", "--from", "mlflow", "--dataset-name", "x", "--split", "train", "--output", "o")
    assert done.exit_code == 1
    assert "no MLflow server: set MLFLOW_TRACKING_URI, or mlflow_tracking_uri in env.yaml" in done.stderr
    assert not (author / "mlruns").exists() and not (author / "mlflow.db").exists()


def test_without_the_mlflow_package_the_error_names_the_extra(author):
    # the package made unimportable in this process only, as if the extra were not installed
    script = "import sys; sys.modules['mlflow'] = None; from gym_grpc.cli.app import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", script, "dataset", "download", "--from", "mlflow", "--dataset-name", "x",
         "--split", "train", "--output", "o"],
        capture_output=True, text=True, timeout=120, cwd=author,
    )  # fmt: skip
    assert done.returncode == 1
    assert "the MLflow registry needs the mlflow client: pip install 'gym-grpc[mlflow]'" in done.stderr


@pytest.fixture
def recording_proxy(server):
    """A forwarding HTTP proxy in front of the server that records each request's Authorization header
    (an `mlflow server` takes any token: this is how to see which one the client sent)."""
    import http.server
    import threading

    seen: list[str | None] = []

    class Forward(http.server.BaseHTTPRequestHandler):
        def _forward(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            request = urllib.request.Request(server + self.path, data=body, headers=headers, method=self.command)
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    status, payload, kind = answer.status, answer.read(), answer.headers.get("Content-Type")
            except urllib.error.HTTPError as e:
                status, payload, kind = e.code, e.read(), e.headers.get("Content-Type")
            self.send_response(status)
            self.send_header("Content-Type", kind or "application/octet-stream")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        def log_message(self, *args) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}", seen
    proxy.shutdown()
    proxy.server_close()
    thread.join()


def test_the_env_yaml_token_is_sent_as_a_bearer_token_and_never_printed(author, recording_proxy, request):
    url, seen = recording_proxy
    token = "glpat-secret-token-1234"
    (author / "env.yaml").write_text(f"mlflow_tracking_uri: {url}\nmlflow_tracking_token: {token}\n")
    name = _name(request)
    done = _cli("dataset", "upload", str(VALIDATION), "--to", "mlflow", "--dataset-name", name)
    assert done.exit_code == 0, done.output
    assert seen and set(seen) == {f"Bearer {token}"}
    missing = _cli("dataset", "download", "--from", "mlflow", "--dataset-name", name, "--version", "5",
                   "--split", "train", "--output", "o.jsonl")  # fmt: skip
    assert missing.exit_code == 1 and f"dataset {name!r} has no version '5'" in missing.stderr
    assert token not in done.output + missing.output
