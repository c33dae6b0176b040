"""Configs: files merged in order, includes, overrides, relative entrypoints, clear errors."""

import re

import pytest
import yaml

from gym_grpc.engines.settings import KEEPALIVE_SECONDS
from gym_grpc.launch.config import ConfigError, dump_config, load_config, set_env_values
from gym_grpc.server.entrypoints import load_entrypoint
from gym_grpc.server.serving import GymServer
from tests.support import REPO


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_later_files_and_overrides_win(tmp_path):
    a = _write(tmp_path / "a.yaml", "servers:\n  m:\n    entrypoint: pkg.mod:M\n    config: {x: 1, y: 2}\n")
    b = _write(tmp_path / "b.yaml", "servers:\n  m:\n    config: {y: 3}\nregistry: {port: 7}\n")
    config = load_config([a, b], ["servers.m.config.x=10", "registry.host=0.0.0.0"])
    assert config.servers["m"].config == {"x": 10, "y": 3}
    assert (config.registry.host, config.registry.port) == ("0.0.0.0", 7)


def test_includes_and_file_entrypoints_resolve_relative_to_their_file(tmp_path):
    _write(tmp_path / "env" / "config.yaml", "servers:\n  env:\n    entrypoint: server.py:Env\n")
    main = _write(tmp_path / "configs" / "main.yaml", "include: [../env/config.yaml]\nservers:\n  env: {port: 9}\n")
    spec = load_config([main]).servers["env"]
    assert spec.entrypoint == f"{tmp_path / 'env' / 'server.py'}:Env"
    assert spec.port == 9


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("servers:\n  m: {entrypoint: a:B, prot: 1}\n", [], "servers.m.prot: Extra inputs are not permitted"),
        ("servers:\n  m: {entrypoint: a:B, port: 70000}\n", [], "servers.m.port"),
        ("servers: [1, 2]\n", [], "servers"),
        ("servers: {m: {entrypoint: a:B}}\n", ["registry.port"], "expected key=value"),
        ("- not a mapping\n", [], "expected a mapping"),
        ("servers: {m: {entrypoint: a:B}\n", [], "not valid YAML"),
        ("include: [self.yaml]\n", [], "includes itself"),
        ("servers: {m: {entrypoint: a:B, replicas: 3}}\n", [], "servers.m.replicas: 3 replicas need a Ray cluster"),
        ("servers: {m: {entrypoint: a:B, num_workers: 2}}\n", ["ray.address=auto"], "under Ray each replica is one"),
        ("servers: {m: {entrypoint: a:B, port: 8000}}\n", ["ray.address=auto"], "servers.m.port: under Ray"),
        ("servers: {m: {entrypoint: a:B}}\nray: {placement: SPREAD}\n", [], "ray.placement: Extra inputs"),
        ("servers: {m: {entrypoint: a:B}}\n", ["ray.placement_strategy=SPRED"], "ray.placement_strategy"),
        ("servers: {m: {entrypoint: a:B, metrics_port: 70000}}\n", [], "servers.m.metrics_port: Input should be"),
        ("servers: {m: {entrypoint: a:B, metrics_port: -1}}\n", [], "servers.m.metrics_port: Input should be"),
        (
            "servers: {m: {entrypoint: a:B, metrics_port: 65535, num_workers: 2}}\n",
            [],
            "servers.m.metrics_port: 2 workers serve metrics on ports 65535 to 65536, past 65535",
        ),
        (
            "servers: {m: {entrypoint: a:B, metrics_port: 50050}}\n",
            [],
            "servers.m.metrics_port: port 50050 is also registry.port",
        ),
        (
            "servers: {m: {entrypoint: a:B, port: 9001}, n: {entrypoint: a:B, metrics_port: 9000, num_workers: 2}}\n",
            [],
            "servers.n.metrics_port: port 9001 (worker 1) is also servers.m.port",
        ),
        (
            "servers: {m: {entrypoint: a:B, metrics_port: 9000}}\n",
            ["ray.address=auto"],
            "servers.m.metrics_port: under Ray each replica serves its metrics on a free port",
        ),
    ],
)
def test_a_bad_config_names_what_is_wrong(tmp_path, text, overrides, message):
    path = _write(tmp_path / "self.yaml", text)
    with pytest.raises(ConfigError) as error:
        load_config([path], overrides)
    assert message in str(error.value)


def test_the_quickstart_config_names_real_server_classes():
    config = load_config([REPO / "configs" / "quickstart.yaml"])
    assert set(config.servers) == {"policy_model", "weather", "weather_agent", "math", "math_agent"}
    for spec in config.servers.values():
        cls = load_entrypoint(spec.entrypoint)
        assert issubclass(cls, GymServer)
        cls(spec.config)  # each config block validates against its class


@pytest.mark.parametrize(
    "entrypoint, message",
    [
        ("nonsense", "expected 'path/to/file.py:Class'"),
        ("/no/such/file.py:X", "no such file"),
        ("gym_grpc.no_such_module:X", "cannot import"),
        ("gym_grpc.server.serving:ServerConfig", "no GymServer subclass"),
    ],
)
def test_a_bad_entrypoint_names_what_is_wrong(entrypoint, message):
    with pytest.raises(ConfigError) as error:
        load_entrypoint(entrypoint)
    assert message in str(error.value)


def test_a_bad_server_config_block_names_the_field():
    from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent

    with pytest.raises(ConfigError) as error:
        SimpleAgent({"model_server": "m", "resources_server": "r", "max_steps": 0}, name="agent")
    assert "server 'agent': config.max_steps" in str(error.value)


def test_env_yaml_supplies_variables_that_servers_interpolate(tmp_path, monkeypatch):
    config = _write(
        tmp_path / "model.yaml",
        "servers:\n  m:\n    entrypoint: a:B\n"
        "    config: {base_url: '${policy_base_url}/v1', api_key: '${policy_api_key}', port: '${engine_port}',"
        " user: '${LOGNAME_FOR_TEST}'}\n",
    )
    _write(tmp_path / "env.yaml", "policy_base_url: http://gpu:8000\npolicy_api_key: sk-secret\nengine_port: 8000\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOGNAME_FOR_TEST", "me")
    spec = load_config([config]).servers["m"]
    assert spec.config == {"base_url": "http://gpu:8000/v1", "api_key": "sk-secret", "port": 8000, "user": "me"}


def test_every_unknown_variable_is_named_at_once_with_where_it_is_used(tmp_path):
    text = (
        "servers:\n  m:\n    entrypoint: a:B\n    config: {url: '${nowhere}', key: '${absent}', again: '${nowhere}'}\n"
    )
    config = _write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError) as error:
        load_config([config], env_file=_write(tmp_path / "secrets.yaml", "other: 1\n"))
    assert str(error.value) == (
        "unknown variables (set them in env.yaml or in the environment): ${absent} in servers.m.config.key; "
        "${nowhere} in servers.m.config.url, servers.m.config.again"
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("profiling_enable=true", "'profiling_enable' is no setting, and no ${profiling_enable} uses it; did you mean"),
        (
            "servers.mathagent.config.max_steps=4",
            "no server 'mathagent' in the configuration; did you mean 'math_agent'",
        ),
    ],
)
def test_a_mistyped_override_is_refused_with_a_suggestion(tmp_path, override, message):
    config = _write(tmp_path / "c.yaml", "servers:\n  math_agent: {entrypoint: a:B}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([config], [override], env_file=_write(tmp_path / "env.yaml", "{}\n"))


def test_a_command_line_variable_that_a_server_uses_is_taken(tmp_path):
    config = _write(tmp_path / "c.yaml", "servers:\n  m: {entrypoint: a:B, config: {url: '${base}'}}\n")
    env = _write(tmp_path / "env.yaml", "{}\n")
    spec = load_config([config], ["base=http://x/v1", "servers.n.entrypoint=c:D"], env_file=env).servers
    assert spec["m"].config == {"url": "http://x/v1"} and spec["n"].entrypoint == "c:D"


@pytest.mark.parametrize("name", ["vllm.yaml", "openai.yaml"])
def test_the_engine_configs_validate_with_the_env_yaml_keys(tmp_path, name):
    env = _write(
        tmp_path / "env.yaml",
        "policy_base_url: http://gpu:8000/v1\npolicy_api_key: sk-x\npolicy_model_name: Qwen/Qwen3-4B\n",
    )
    config = load_config([REPO / "configs" / name, REPO / "servers/resources/math/config.yaml"], env_file=env)
    spec = config.servers["policy_model"]
    server = load_entrypoint(spec.entrypoint)(spec.config, name="policy_model")
    assert server.config.base_url == ["http://gpu:8000/v1"] and server.config.api_key == "sk-x"
    assert config.servers["math_agent"].config["model_server"] == "policy_model"
    if name == "vllm.yaml":  # no policy_keepalive_seconds: the default, under vLLM's own 5 s
        assert server.config.keepalive_seconds == KEEPALIVE_SECONDS


def test_the_vllm_config_keeps_connections_as_long_as_env_yaml_says(tmp_path):
    """`gym-grpc engine start` writes policy_keepalive_seconds (its engine keeps a connection 300 s)."""
    env = _write(
        tmp_path / "env.yaml",
        "policy_base_url: http://127.0.0.1:8000/v1\npolicy_api_key: EMPTY\npolicy_model_name: m\n"
        "policy_keepalive_seconds: '290'\n",
    )
    spec = load_config([REPO / "configs" / "vllm.yaml"], env_file=env).servers["policy_model"]
    assert load_entrypoint(spec.entrypoint)(spec.config, name="policy_model").config.keepalive_seconds == 290.0


#: A server whose config block takes any keys, for the tests of the dump.
FREE_SERVER = """
from pydantic import ConfigDict

from gym_grpc.model import ModelServer
from gym_grpc.server.serving import ServerConfig


class AnyConfig(ServerConfig):
    model_config = ConfigDict(extra="allow")


class Free(ModelServer):
    Config = AnyConfig
"""


def test_dump_config_masks_every_secret_variable_wherever_it_is_interpolated(tmp_path, monkeypatch):
    _write(tmp_path / "free_server.py", FREE_SERVER)
    config = _write(
        tmp_path / "model.yaml",
        "team_secret: s3cret-from-yaml\n"
        "servers:\n  m:\n    entrypoint: free_server.py:Free\n    config:\n"
        "      api_key: ${OPENAI_API_KEY}\n"
        "      base_url: https://user:${DB_PASSWORD}@gpu:8000/v1\n"
        "      headers: {Authorization: 'Bearer ${HF_TOKEN}', X-Team: '${team_secret}', X-Run: '${run_token}'}\n"
        "      policy_url: ${POLICY_URL}\n"
        "      pin_password: 123456\n",
    )
    secrets = {"OPENAI_API_KEY": "sk-env-1111", "DB_PASSWORD": "pw-env-2222", "HF_TOKEN": "hf-env-3333"}
    for name, value in {**secrets, "POLICY_URL": "http://gpu:8000"}.items():
        monkeypatch.setenv(name, value)
    dumped = dump_config([config], ["run_token=tok-override-4444"], env_file=_write(tmp_path / "env.yaml", "x: 1\n"))
    for secret in [*secrets.values(), "s3cret-from-yaml", "tok-override-4444", "123456"]:
        assert secret not in dumped
    config_block = yaml.safe_load(dumped)["servers"]["m"]["config"]
    assert config_block == {
        "api_key": "***",
        "base_url": "https://user:***@gpu:8000/v1",
        "headers": {"Authorization": "Bearer ***", "X-Team": "***", "X-Run": "***"},
        "policy_url": "http://gpu:8000",  # not a secret: shown, so the dump still says where things go
        "pin_password": "***",
    }


def test_dump_config_masks_values_shaped_like_secrets_whatever_holds_them(tmp_path):
    """A name that does not look secret still holds one: a URL's password, a key with a well-known
    prefix, a long random word; and a name with `credentials` is a secret's too."""
    _write(tmp_path / "free_server.py", FREE_SERVER)
    config = _write(
        tmp_path / "model.yaml",
        "servers:\n  m:\n    entrypoint: free_server.py:Free\n    config:\n"
        "      proxy: ${proxy_credentials}\n"
        "      upstream: http://bob:hunter2@proxy:3128\n"
        "      header: 'Bearer ${bearer}'\n"
        "      opaque: ${opaque}\n"
        "      model: SmolLM2-135M-Instruct\n"
        "      base_url: http://127.0.0.1:8000/v1\n",
    )
    env = _write(
        tmp_path / "env.yaml",
        "proxy_credentials: alice:wonderland\n"
        "bearer: sk-proj-abcdefghijklmnop0123456789\n"
        "opaque: Zx81Kq0pL4mN7bV2cX9aS3dF6gH1jK5l\n",
    )
    dumped = dump_config([config], [], env_file=env)
    for secret in ("wonderland", "hunter2", "sk-proj-abcdefghijklmnop0123456789", "Zx81Kq0pL4mN7bV2cX9aS3dF6gH1jK5l"):
        assert secret not in dumped
    config_block = yaml.safe_load(dumped)["servers"]["m"]["config"]
    assert config_block == {
        "proxy": "***",
        "upstream": "http://bob:***@proxy:3128",
        "header": "Bearer ***",
        "opaque": "***",
        "model": "SmolLM2-135M-Instruct",  # neither a secret's name nor a secret's shape
        "base_url": "http://127.0.0.1:8000/v1",
    }


def test_set_env_values_keeps_other_keys_and_comments(tmp_path):
    env = _write(
        tmp_path / "env.yaml",
        "# secrets\nhf_token: abc  # the Hub\npolicy_base_url:\n  - http://a:8000/v1\n  - http://b:8000/v1\n"
        "# the model\npolicy_model_name: old\nlast: 3",
    )
    new = {"policy_base_url": "http://127.0.0.1:5/v1", "policy_api_key": "EMPTY", "policy_model_name": "m"}
    assert set_env_values(env, new) is True
    assert env.read_text() == (
        "# secrets\nhf_token: abc  # the Hub\npolicy_base_url: http://127.0.0.1:5/v1\n"
        "# the model\npolicy_model_name: m\nlast: 3\npolicy_api_key: EMPTY\n"
    )


def test_set_env_values_rewrites_a_layout_it_cannot_edit_and_says_so(tmp_path):
    env = _write(tmp_path / "env.yaml", "# a comment\n{a: 1, policy_api_key: x}\n")
    assert set_env_values(env, {"policy_api_key": "EMPTY"}) is False
    assert yaml.safe_load(env.read_text()) == {"a": 1, "policy_api_key": "EMPTY"}


def test_set_env_values_creates_the_file_and_refuses_one_that_is_not_a_mapping(tmp_path):
    assert set_env_values(tmp_path / "env.yaml", {"k": "v: with a colon"}) is True
    assert yaml.safe_load((tmp_path / "env.yaml").read_text()) == {"k": "v: with a colon"}
    listed = _write(tmp_path / "list.yaml", "- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        set_env_values(listed, {"k": "v"})
    assert listed.read_text() == "- 1\n"


def test_replicas_on_ray_validate_with_the_placement_defaults(tmp_path):
    path = _write(tmp_path / "c.yaml", "servers:\n  m: {entrypoint: a:B, replicas: 4, num_cpus: 0.5}\n")
    config = load_config([path], ["ray.address=10.0.0.1:6379"])
    assert config.ray is not None
    ray = config.ray
    assert (ray.address, ray.placement_strategy, ray.max_restarts) == ("10.0.0.1:6379", "SPREAD", 3)
    assert (config.servers["m"].replicas, config.servers["m"].num_cpus) == (4, 0.5)
    assert load_config([_write(tmp_path / "d.yaml", "servers: {m: {entrypoint: a:B}}\n")], []).ray is None


def test_dump_config_checks_every_server_config_block_as_a_server_process_does():
    quickstart = REPO / "configs" / "quickstart.yaml"
    overrides = ["servers.math_agent.config.max_step=4", "servers.weather_agent.config.max_steps=0"]
    with pytest.raises(ConfigError) as error:
        dump_config([quickstart], overrides)
    message = str(error.value)
    assert "server 'math_agent': config.max_step: Extra inputs are not permitted (did you mean 'max_steps'?)" in message
    assert "server 'weather_agent': config.max_steps: Input should be greater than or equal to 1" in message
    from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent

    config = {"model_server": "m", "resources_server": "r", "max_step": 4}
    with pytest.raises(ConfigError, match=re.escape("config.max_step: Extra inputs are not permitted (did you mean")):
        SimpleAgent(config, name="math_agent")  # what the server process of `gym-grpc run` says


def test_a_dataset_takes_nemo_gyms_gitlab_identifier_as_its_mlflow_identifier(tmp_path):
    def config(identifiers: dict) -> str:
        spec = {"name": "t", "type": "train", "jsonl_fpath": "t.jsonl", "license": "Apache 2.0", **identifiers}
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"servers": {"a": {"entrypoint": "a.py:A", "datasets": [spec]}}}))
        return str(path)

    where = {"dataset_name": "math", "version": 3, "artifact_fpath": "train.jsonl"}
    (spec,) = load_config([config({"gitlab_identifier": where})]).servers["a"].datasets
    assert spec.mlflow_identifier is not None and spec.mlflow_identifier.version == "3"
    with pytest.raises(ConfigError, match="give mlflow_identifier or gitlab_identifier"):
        load_config([config({"gitlab_identifier": where, "mlflow_identifier": where})])
    with pytest.raises(ConfigError, match="mlflow_identifier.dataset_nam: Extra inputs"):
        load_config([config({"mlflow_identifier": {"dataset_nam": "x", "artifact_fpath": "a"}})])

    # NeMo Gym 0.7.0's unified `source:` block
    (spec,) = load_config([config({"source": {"type": "gitlab", **where}})]).servers["a"].datasets
    assert spec.mlflow_identifier is not None and spec.mlflow_identifier.dataset_name == "math"
    hub = {"type": "huggingface", "repo_id": "o/r", "artifact_fpath": "train.jsonl"}
    (spec,) = load_config([config({"source": hub})]).servers["a"].datasets
    assert spec.huggingface_identifier is not None and spec.huggingface_identifier.repo_id == "o/r"
    with pytest.raises(ConfigError, match="give source or mlflow_identifier, not both"):
        load_config([config({"source": hub, "gitlab_identifier": where})])
    with pytest.raises(ConfigError, match="whose type is one of gitlab, mlflow, huggingface"):
        load_config([config({"source": {"type": "s3"}})])


def test_a_variable_with_a_default_needs_no_value_and_takes_one_when_given(tmp_path):
    _write(tmp_path / "free_server.py", FREE_SERVER)
    config = _write(
        tmp_path / "model.yaml",
        "servers:\n  m:\n    entrypoint: free_server.py:Free\n    config:\n"
        "      tokenizer_dir: ${policy_tokenizer_dir:-}\n"
        "      url: http://${host:-localhost}:8000/v1\n",
    )
    env = _write(tmp_path / "env.yaml", "x: 1\n")
    block = load_config([config], [], env_file=env).servers["m"].config
    assert block == {"tokenizer_dir": "", "url": "http://localhost:8000/v1"}
    block = load_config([config], ["policy_tokenizer_dir=/models/m", "host=gpu"], env_file=env).servers["m"].config
    assert block == {"tokenizer_dir": "/models/m", "url": "http://gpu:8000/v1"}
