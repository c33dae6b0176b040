"""`gym-grpc envs list|show|search`: the environments read from their configs and servers.

The commands run as a user runs them (click's runner in this process; the servers
are described by real child processes, as in use), over the bundled environments
and over real directories the tests write: a config, a server module, data.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from gym_grpc import bundled
from gym_grpc.cli.app import main
from gym_grpc.launch import catalog
from gym_grpc.server.entrypoints import load_entrypoint
from tests.support import REPO

RESOURCES = REPO / "servers" / "resources"

pytestmark = pytest.mark.slow  # each command describes every environment in child processes: seconds

SERVER = '''
"""Capital quiz: name the capital of a country."""

from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import final_text


class {cls}(ResourcesServer):
    verifier_fields = {{"named_capital": "the final answer names the expected capital"}}

    @tool
    async def {tool}(self, country: str) -> str:
        """{tool_doc}"""
        return "Paris"

    async def verify(self, session: Session, response) -> Verification:
        named = str(session.data.get("expected_answer", "")).lower() in final_text(response).lower()
        return Verification(reward=float(named), fields={{"named_capital": named}})
'''

CONFIG = """
servers:
  {name}:
    entrypoint: server.py:{cls}
    license: MIT
    {description}
  {name}_agent:
    entrypoint: gym_grpc.agent:ToolLoopAgent
    config: {{model_server: policy_model, resources_server: {name}, max_steps: 2}}
    datasets:
      - {{name: example, type: example, jsonl_fpath: data/example.jsonl}}
      - {{name: quiz_train, type: train, jsonl_fpath: data/train.jsonl, license: CC-BY-4.0}}
"""


def write_env(
    parent: Path,
    name: str,
    *,
    cls: str = "QuizEnv",
    tool: str = "lookup_capital",
    tool_doc: str = "Look up the capital city of a country.",
    description: str | None = "Name the capital of a country, with a lookup tool.",
    server: str | None = None,
    config: str | None = None,
    rows: int = 3,
) -> Path:
    """A real environment directory: server.py (no __init__.py: a plain module), config.yaml, data."""
    directory = parent / name
    (directory / "data").mkdir(parents=True)
    text = server if server is not None else SERVER.format(cls=cls, tool=tool, tool_doc=tool_doc)
    (directory / "server.py").write_text(textwrap.dedent(text).lstrip())
    line = f"description: {json.dumps(description)}" if description else ""
    (directory / "config.yaml").write_text(config or CONFIG.format(name=name, cls=cls, description=line))
    row = {"responses_create_params": {"input": "Capital of France?"}, "expected_answer": "Paris"}
    (directory / "data" / "example.jsonl").write_text((json.dumps(row) + "\n") * rows + "\n")
    return directory


_PROBED: dict[str, dict[str, Any]] = {}


@pytest.fixture(autouse=True)
def bundled_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing a config imports its environments' dependencies in a child process, seconds each,
    and every listing probes every bundled config. The bundled files do not change while the tests
    run, so each bundled config is probed once per test process and its answer reused; the
    environments the tests write are probed every time."""
    probe = catalog._probe
    servers_dir = bundled.server_dir()

    def once(servers: list[dict[str, Any]], timeout: float) -> dict[str, dict[str, Any]]:
        files = [Path(str(s["entrypoint"]).rpartition(":")[0]) for s in servers]
        if not files or not all(f.is_absolute() and f.is_relative_to(servers_dir) for f in files):
            return probe(servers, timeout)
        key = json.dumps(servers, sort_keys=True)
        if key not in _PROBED:
            _PROBED[key] = probe(servers, timeout)
        return copy.deepcopy(_PROBED[key])

    monkeypatch.setattr(catalog, "_probe", once)


def envs(*args: str, env: dict[str, str] | None = None, code: int = 0) -> Result:
    done = CliRunner().invoke(main, ["envs", *args], env=env, catch_exceptions=False)
    assert done.exit_code == code, done.output
    return done


def listed(*args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    out = json.loads(envs("list", "--json", *args, env=env).stdout)
    return {e["name"]: e for e in out["environments"]}


def bundled_environments() -> dict[str, tuple[Path, dict[str, Any], list[str]]]:
    """Each bundled environment by name (the servers the agents of a config name): its directory, its
    entry and its agents."""
    out: dict[str, tuple[Path, dict[str, Any], list[str]]] = {}
    for path in sorted(RESOURCES.glob("*/config.yaml")):
        servers = yaml.safe_load(path.read_text())["servers"]
        for agent, spec in servers.items():
            name = (spec.get("config") or {}).get("resources_server")
            if name is not None:
                out.setdefault(name, (path.parent, servers[name], []))[2].append(agent)
    return out


def _example_rows(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (directory / "data" / "example.jsonl").read_text().splitlines() if line]


def test_list_has_every_bundled_environment_with_what_its_config_and_server_say():
    found, bundled = listed(), bundled_environments()
    assert len(bundled) >= 7 and set(bundled) <= set(found)
    for name, (directory, spec, agents) in bundled.items():
        env = found[name]
        cls = load_entrypoint(str(directory / spec["entrypoint"]))
        assert env["source"] == "bundled" and env["notes"] == [], env
        assert env["description"] == spec["description"] and env["license"] == spec["license"] == "Apache-2.0"
        if cls.tools:  # @tool methods: what DescribeTools lists
            assert [t["name"] for t in env["tools"]] == list(cls.tools), name
        else:  # tools known once the server starts (MCP's), or none: the ones its example tasks offer
            offered = {t["name"] for t in _example_rows(directory)[0]["responses_create_params"].get("tools", [])}
            assert {t["name"] for t in env["tools"]} == offered, name
        assert env["verifier_fields"] == cls.verifier_fields and env["verifier_fields"], name
        assert env["agents"] == sorted(agents)
        example = next(d for d in env["datasets"] if d["file"] == "data/example.jsonl")
        lines = (directory / "data" / "example.jsonl").read_text().splitlines()
        assert example["rows"] == sum(1 for line in lines if line.strip()) and example["type"] == "example"


def test_list_prints_a_table_with_a_row_per_environment():
    out = envs("list").stdout.splitlines()
    assert out[0].split() == ["name", "tools", "rows", "license", "source", "description"]
    weather = next(line for line in out if line.startswith("weather "))
    assert weather.split()[:5] == ["weather", "1", "5", "Apache-2.0", "bundled"]
    assert {line.split()[0] for line in out[1:]} >= set(bundled_environments())


def test_show_prints_tools_with_their_arguments_the_verifier_fields_and_the_datasets():
    out = envs("show", "weather").stdout
    assert "get_weather(city: string)  Get the current weather in a city." in out
    assert "reported_temperature  the final answer states that forecast's temperature" in out
    assert "data/example.jsonl  5 rows  example dataset 'example'" in out
    assert "license:  Apache-2.0" in out and "agents:   weather_agent" in out


def test_show_json_lists_training_data_with_its_row_count_and_license():
    math = json.loads(envs("show", "math", "--json").stdout)
    train = next(d for d in math["datasets"] if d["file"] == "data/train.jsonl")
    rows = sum(1 for line in (RESOURCES / "math" / "data" / "train.jsonl").read_text().splitlines() if line.strip())
    assert train == {"file": "data/train.jsonl", "rows": rows, "name": "arithmetic_train", "type": "train"} | {
        "license": "Apache-2.0"
    }
    assert math["tools"] == [] and math["server_class"].endswith(":MathEnv")


def test_a_mistyped_name_is_an_error_that_suggests_the_right_one():
    done = envs("show", "wether", code=1)
    assert "no environment 'wether'; did you mean 'weather'?" in done.stderr


def test_an_agent_is_not_an_environment():
    done = envs("show", "weather_agent", code=1)
    assert "no environment 'weather_agent'; did you mean 'weather'?" in done.stderr


def test_search_matches_names_descriptions_and_tools():
    def names(text: str) -> set[str]:
        return {e["name"] for e in json.loads(envs("search", text, "--json").stdout)["environments"]}

    assert names("refund_order") == {"multi_step"}  # a tool's name (and the description)
    assert names("catalogue") == {"session_state"}  # only in a tool's description
    assert names("MATH-verify") == {"math"}  # the description, any case
    assert names("weather temperature") == {"weather"}  # every word
    assert names("no such thing anywhere") == set()
    done = envs("search", "no such thing anywhere")
    assert done.stdout == "" and "no environment matches 'no such thing anywhere'" in done.stderr


def test_listing_runs_no_environments_code_in_its_own_process(tmp_path):
    """Importing an environment runs its code, which only the probes' child processes do: the
    config's layout, which imports the servers it could group for `gym-grpc run`, is skipped."""
    server = write_env(tmp_path / "mine", "capital_quiz") / "server.py"
    mark = "import os, pathlib\npathlib.Path(__file__).with_name('importers').open('a').write(f'{os.getpid()} ')\n"
    server.write_text(mark + server.read_text())
    assert "capital_quiz" in listed("--path", str(tmp_path / "mine"))
    importers = server.with_name("importers").read_text().split()
    assert importers and str(os.getpid()) not in importers


def test_a_new_environment_on_a_user_path_appears_with_its_tools_fields_datasets_and_license(tmp_path):
    write_env(tmp_path / "mine", "capital_quiz")
    env = listed("--path", str(tmp_path / "mine"))["capital_quiz"]
    assert env["source"] == str(tmp_path / "mine") and env["license"] == "MIT"
    assert env["description"] == "Name the capital of a country, with a lookup tool."
    assert env["tools"] == [
        {
            "name": "lookup_capital",
            "description": "Look up the capital city of a country.",
            "parameters": {
                "type": "object",
                "properties": {"country": {"type": "string"}},
                "required": ["country"],
                "additionalProperties": False,
            },
        }
    ]
    assert env["verifier_fields"] == {"named_capital": "the final answer names the expected capital"}
    assert env["stateless"] is True and env["agents"] == ["capital_quiz_agent"] and env["notes"] == []
    assert env["datasets"] == [
        {"file": "data/example.jsonl", "rows": 3, "name": "example", "type": "example", "license": None},
        {"file": "data/train.jsonl", "rows": None, "name": "quiz_train", "type": "train", "license": "CC-BY-4.0"},
    ]
    out = envs("show", "capital_quiz", "--path", str(tmp_path / "mine")).stdout
    assert "lookup_capital(country: string)" in out
    assert re.search(r"data/train.jsonl +missing  train dataset 'quiz_train', CC-BY-4.0", out)


def test_the_environment_variable_adds_directories_and_a_path_may_be_one_environment(tmp_path):
    write_env(tmp_path / "a", "quiz_a")
    write_env(tmp_path / "b", "quiz_b", tool="capital_of")
    found = listed("--path", str(tmp_path / "b" / "quiz_b"), env={catalog.ENV_PATH_VARIABLE: str(tmp_path / "a")})
    assert found["quiz_a"]["source"] == str(tmp_path / "a")
    assert [t["name"] for t in found["quiz_b"]["tools"]] == ["capital_of"]


def test_two_environments_whose_modules_share_a_name_are_each_read_from_their_own(tmp_path):
    """Both are a plain `server.py` (module name `server`): each config's servers are described apart."""
    write_env(tmp_path, "first", tool="first_tool", tool_doc="The first one.")
    write_env(tmp_path, "second", tool="second_tool", tool_doc="The second one.")
    found = listed("--path", str(tmp_path))
    assert [t["name"] for t in found["first"]["tools"]] == ["first_tool"]
    assert [t["name"] for t in found["second"]["tools"]] == ["second_tool"]


def test_an_environment_without_a_description_is_described_by_its_docstring(tmp_path):
    write_env(tmp_path, "quiz", description=None)
    assert listed("--path", str(tmp_path))["quiz"]["description"] == "Capital quiz: name the capital of a country."


def test_an_environment_whose_dependency_is_missing_is_listed_with_a_note_saying_so(tmp_path):
    server = "import gym_grpc_catalog_test_missing_dependency\n" + SERVER.format(cls="QuizEnv", tool="t", tool_doc="T.")
    write_env(tmp_path, "needs_more", server=server)
    done = envs("list", "--path", str(tmp_path))
    row = next(line for line in done.stdout.splitlines() if line.startswith("needs_more "))
    assert row.split()[:4] == ["needs_more", "?", "3", "MIT"]  # tools unknown; the config still tells the rest
    assert "No module named 'gym_grpc_catalog_test_missing_dependency'" in done.stderr
    env = listed("--path", str(tmp_path))["needs_more"]
    assert env["tools"] is None and env["agents"] == ["needs_more_agent"]
    assert "cannot import" in env["notes"][0] and "needs_more/server.py" in env["notes"][0]
    out = envs("show", "needs_more", "--path", str(tmp_path)).stdout
    assert "tools:    unknown (see the notes)" in out and "note: entrypoint" in out


@pytest.mark.parametrize(
    ("module", "package", "extra"),
    [
        ("gymnasium_envs.server", "gymnasium", "gymnasium"),
        ("mcp_tools.server", "jsonschema", "mcp"),
        ("mcp_tools.server", "mcp", "mcp"),
        ("reasoning_gym_tasks.server", "reasoning_gym", "reasoning-gym"),
        ("textarena_games.server", "textarena", "textarena"),
    ],
)
def test_a_bundled_environment_whose_extra_is_missing_names_the_extra_to_install(module, package, extra):
    """In a real interpreter whose first import finder says the package is not there."""
    code = textwrap.dedent(f"""
        import sys
        class Missing:
            def find_spec(self, name, path=None, target=None):
                if name == {package!r} or name.startswith({package!r} + "."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Missing())
        import gym_grpc.bundled.servers.resources.{module}
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"({package}): pip install 'gym-grpc[{extra}]'" in done.stderr.splitlines()[-1], done.stderr[-2000:]


def test_a_config_block_its_server_does_not_take_is_a_note_naming_the_key(tmp_path):
    config = CONFIG.format(name="quiz", cls="QuizEnv", description="").replace(
        "license: MIT", "license: MIT\n    config: {max_sesions: 3}"
    )
    write_env(tmp_path, "quiz", config=config)
    (note,) = listed("--path", str(tmp_path))["quiz"]["notes"]
    assert "server 'quiz': config.max_sesions" in note and "did you mean 'max_sessions'" in note


def test_a_config_that_does_not_load_still_lists_what_it_names_with_the_error(tmp_path):
    config = CONFIG.format(name="quiz", cls="QuizEnv", description="").replace("license: MIT", "licence: MIT")
    write_env(tmp_path, "quiz", config=config)
    env = listed("--path", str(tmp_path))["quiz"]
    assert env["tools"] is None and "its config does not load" in env["notes"][0] and "licence" in env["notes"][0]


def test_what_cannot_be_told_an_environment_is_left_out_and_said_so_the_rest_listed(tmp_path):
    write_env(tmp_path, "fine")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.yaml").write_text("servers: [\n")
    (tmp_path / "lonely").mkdir()  # a server no agent names, whose module does not import: its role is unknown
    (tmp_path / "lonely" / "config.yaml").write_text("servers:\n  lonely:\n    entrypoint: no_such_module_here:Env\n")
    done = envs("list", "--path", str(tmp_path))
    assert any(line.startswith("fine ") for line in done.stdout.splitlines())
    assert "broken" not in done.stdout and "lonely" not in done.stdout
    left_out = [line for line in done.stderr.splitlines() if line.startswith("left out: ")]
    assert len(left_out) == 2
    assert any("broken/config.yaml: not valid YAML" in line for line in left_out)
    assert any("lonely/config.yaml: server 'lonely': entrypoint 'no_such_module_here:Env'" in line for line in left_out)
    problems = json.loads(envs("list", "--json", "--path", str(tmp_path)).stdout)["problems"]
    assert len(problems) == 2


def test_tools_that_exist_only_once_the_server_started_are_listed(tmp_path):
    """An environment that wraps another framework finds its tools at start (tool_schemas overridden)."""
    server = '''
        from gym_grpc.resources import ResourcesServer
        from gym_grpc.v1 import responses_pb2 as r


        class WrappedEnv(ResourcesServer):
            """Tools from elsewhere."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.found = []

            async def start(self):
                await super().start()
                self.found = [r.FunctionTool(name="remote_search", description="Search elsewhere.")]

            def tool_schemas(self):
                return self.found

            async def verify(self, session, response):
                return 0.0
    '''
    write_env(tmp_path, "wrapped", server=server, cls="WrappedEnv")
    env = listed("--path", str(tmp_path))["wrapped"]
    assert [(t["name"], t["description"]) for t in env["tools"]] == [("remote_search", "Search elsewhere.")]
    assert env["verifier_fields"] == {}
    assert "verifier fields: not declared" in envs("show", "wrapped", "--path", str(tmp_path)).stdout


def test_a_verifiers_taskset_served_as_an_environment_lists_the_tools_its_taskset_gives(tmp_path):
    """The real verifiers package: its tools are known only once the server has built its catalogue."""
    (tmp_path / "capitals").mkdir()
    (tmp_path / "capitals" / "config.yaml").write_text(
        "servers:\n"
        "  capitals:\n"
        "    entrypoint: gym_grpc.adapters.verifiers_server:VerifiersTasksetServer\n"
        "    config: {taskset: examples.verifiers_taskset:CapitalsTaskset}\n"
    )
    env = json.loads(envs("show", "capitals", "--json", "--path", str(tmp_path)).stdout)
    assert [t["name"] for t in env["tools"]] == ["capital_of"] and env["notes"] == []
    assert env["server_class"] == "gym_grpc.adapters.verifiers_server:VerifiersTasksetServer"
    assert env["description"] == "A verifiers taskset's tasks, tools and rewards behind gym-grpc's ResourcesService."


def test_a_server_that_hangs_while_imported_costs_only_its_own_entry(tmp_path):
    server = "import time\ntime.sleep(3600)\n" + SERVER.format(cls="QuizEnv", tool="t", tool_doc="T.")
    write_env(tmp_path, "hangs", server=server)
    found = catalog.find([tmp_path], only="hangs", timeout=5)
    (env,) = found.environments
    assert env.tools is None and env.notes == ["it did not describe itself within 5 s"]


def test_a_user_environment_hides_a_bundled_one_of_the_same_name_and_says_so(tmp_path):
    write_env(tmp_path, "weather", cls="MyWeather", tool="my_weather")
    env = listed("--path", str(tmp_path))["weather"]
    assert [t["name"] for t in env["tools"]] == ["my_weather"]
    (note,) = env["notes"]
    assert note.startswith("it hides another 'weather', in ") and note.endswith("servers/resources/weather/config.yaml")


def test_a_search_path_without_environments_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    done = envs("list", "--path", str(tmp_path / "empty"), code=1)
    assert f"{tmp_path / 'empty'}: no environment there" in done.stderr
    done = envs("list", env={catalog.ENV_PATH_VARIABLE: str(tmp_path / "nowhere")}, code=1)
    assert f"{catalog.ENV_PATH_VARIABLE}: '{tmp_path / 'nowhere'}' is not a directory" in done.stderr
    assert "does not exist" in envs("list", "--path", str(tmp_path / "nowhere"), code=2).stderr


def test_the_installed_command_lists_an_environment_from_the_environment_variable(tmp_path):
    write_env(tmp_path, "capital_quiz")
    gym = shutil.which("gym-grpc", path=str(Path(sys.executable).parent))
    assert gym, "gym-grpc is not installed: pip install -e '.[test]'"
    done = subprocess.run(
        [gym, "envs", "show", "capital_quiz"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, catalog.ENV_PATH_VARIABLE: str(tmp_path)},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("capital_quiz\n") and f"  source:   {tmp_path}\n" in done.stdout
    assert "lookup_capital(country: string)" in done.stdout
