"""What servers say about themselves without serving, for `gym-grpc envs`: run in a child process.

    python -m gym_grpc.launch.catalog_probe < servers.json > described.json

The input is a JSON list of `{"name", "entrypoint", "config"}`, the servers of
one config file; the output a JSON object with, for each name, its role and
class and, for a resources server, its tools, its declared verifier fields
and whether it keeps state, or `error` when it could not be loaded.

A child process per config file, because importing an environment runs its
code: two environments on a user's path may both be `server.py` outside a
package (one module name, `server`, for both), an import may hang or crash,
and a server's start may spawn workers. The catalog's own process stays
clean, and a child that misbehaves costs only its config's entries.

A resources server is instantiated with its config (which checks the config
as `gym-grpc run` does) and asked for `tool_schemas()`, what DescribeTools
serves. Most environments' tools are their `@tool` methods, known without
starting; one that overrides `tool_schemas` (a wrapped framework's tools,
discovered at start) is started, asked and stopped, never served.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
from typing import Any

from gym_grpc.errors import ConfigError
from gym_grpc.resources import ResourcesServer
from gym_grpc.server.entrypoints import load_entrypoint
from gym_grpc.v1 import registry_service_pb2 as reg

ROLES = {
    reg.SERVER_ROLE_RESOURCES: "resources",
    reg.SERVER_ROLE_AGENT: "agent",
    reg.SERVER_ROLE_MODEL: "model",
}


def _first_paragraph(text: str | None) -> str:
    return " ".join(inspect.cleandoc(text or "").split("\n\n", 1)[0].split())


def _docstring(cls: type) -> str:
    """The class's own docstring (not a base's), else its module's: the first paragraph."""
    own = cls.__dict__.get("__doc__")
    if own:
        return _first_paragraph(own)
    return _first_paragraph(getattr(sys.modules.get(cls.__module__), "__doc__", None))


async def _started_tools(app: ResourcesServer) -> list[Any]:
    await app.start()
    try:
        return list(app.tool_schemas())
    finally:
        await app.stop()


def describe(name: str, entrypoint: str, config: dict[str, Any]) -> dict[str, Any]:
    """One server as the catalog shows it; `error` says why it could not be described."""
    try:
        cls = load_entrypoint(entrypoint)
    except ConfigError as e:  # it names the entrypoint and what is missing
        return {"error": str(e)}
    except Exception as e:  # an import runs the server's module: anything may fail there
        return {"error": f"entrypoint {entrypoint!r}: importing it raised {_reason(e)}"}
    out: dict[str, Any] = {
        "role": ROLES.get(cls.role, "unknown"),
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "doc": _docstring(cls),
    }
    if not issubclass(cls, ResourcesServer):
        return out
    out["verifier_fields"] = dict(cls.verifier_fields)
    out["stateless"] = cls.stateless
    try:
        app = cls(config, name=name)
        if type(app).tool_schemas is ResourcesServer.tool_schemas:
            schemas = app.tool_schemas()
        else:
            schemas = asyncio.run(_started_tools(app))
    except ConfigError as e:
        out["error"] = str(e)
        return out
    except Exception as e:
        out["error"] = f"{cls.__qualname__}({name!r}) raised {_reason(e)}"
        return out
    out["tools"] = [
        {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json or "{}")}
        for t in schemas
    ]
    return out


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def main() -> None:
    servers = json.load(sys.stdin)
    # The answer goes to the real stdout; whatever the servers print (C code and children
    # included) goes to stderr, so that it cannot corrupt the JSON.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    described = {s["name"]: describe(s["name"], s["entrypoint"], s.get("config") or {}) for s in servers}
    json.dump(described, answer)
    answer.close()


if __name__ == "__main__":
    main()
