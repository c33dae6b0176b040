"""Loading a server class from its entrypoint string.

"package.module:Class" is imported. "/path/to/file.py:Class" is imported as
part of its package: the nearest parent directory without an __init__.py is
put on sys.path and the file is imported by its dotted name, so that a
server can use relative imports and its tests import the very same module.

A file of the bundled servers (gym_grpc/bundled) has one name wherever it is
read from: `gym_grpc.bundled.servers.…`, also in a checkout, whose top-level
servers/ directory that package maps to. Imported by a second name, a module
would run twice and its classes would be two (an agent `isinstance` of one
and not of the other).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TypeVar

from gym_grpc import bundled
from gym_grpc.errors import ConfigError
from gym_grpc.server.serving import GymServer

_BUNDLED_SERVERS = bundled.server_dir()


def _module_name(path: Path) -> tuple[str, Path | None]:
    """The dotted name `path` is imported by, and the directory to put on sys.path for it (None:
    the bundled servers, importable as they are)."""
    if path.is_relative_to(_BUNDLED_SERVERS):
        inside = path.relative_to(_BUNDLED_SERVERS).with_suffix("").parts
        return ".".join(("gym_grpc", "bundled", "servers", *inside)), None
    parts = [path.stem]
    directory = path.parent
    while (directory / "__init__.py").exists():
        parts.append(directory.name)
        directory = directory.parent
    return ".".join(reversed(parts)), directory


T = TypeVar("T")


def load_entrypoint(entrypoint: str) -> type[GymServer]:
    """The GymServer subclass an entrypoint names (ConfigError when it cannot)."""
    return load_class(entrypoint, GymServer, "GymServer subclass")


def load_class(entrypoint: str, base: type[T], what: str) -> type[T]:
    """The subclass of `base` an entrypoint names (ConfigError, saying `what` was expected, when it cannot)."""
    target, sep, class_name = entrypoint.rpartition(":")
    if not sep or not target or not class_name:
        raise ConfigError(f"entrypoint {entrypoint!r}: expected 'path/to/file.py:Class' or 'module:Class'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ConfigError(f"entrypoint {entrypoint!r}: no such file {path}")
        module_name, root = _module_name(path)
        if root is not None and str(root) not in sys.path:
            sys.path.insert(0, str(root))
    else:
        module_name = target
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"entrypoint {entrypoint!r}: cannot import {module_name}: {e}") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"entrypoint {entrypoint!r}: {module_name} has no {what} {class_name!r}")
    return cls
