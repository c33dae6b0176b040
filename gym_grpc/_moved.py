"""The import paths modules had before they moved into folders, kept working with a warning.

`import gym_grpc.rows` (or anything below a moved module) loads the module at its
new path once, so both names reach the same module object and patching one
patches the other. Only modules code outside this repository may import are
listed; remove this file when the old paths have had a release of warnings.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

MOVED = {
    "gym_grpc.clients": "gym_grpc.client.stubs",
    "gym_grpc.serving": "gym_grpc.server.serving",
    "gym_grpc.entrypoints": "gym_grpc.server.entrypoints",
    "gym_grpc.validation": "gym_grpc.server.validation",
    "gym_grpc.open_files": "gym_grpc.server.open_files",
    "gym_grpc.transport": "gym_grpc.rpc.transport",
    "gym_grpc.security": "gym_grpc.rpc.security",
    "gym_grpc.registry": "gym_grpc.rpc.registry",
    "gym_grpc.rows": "gym_grpc.data.rows",
    "gym_grpc.json_input": "gym_grpc.data.json_input",
    "gym_grpc.jsonl": "gym_grpc.data.jsonl",
    "gym_grpc.dataset_stats": "gym_grpc.data.dataset_stats",
    "gym_grpc.collector": "gym_grpc.batch.collector",
    "gym_grpc.local_vllm": "gym_grpc.engines.local_vllm",
}


def new_name(name: str) -> str | None:
    """The current name of a module imported by its old name, or None if it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}  # by new name

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        return importlib.util.spec_from_loader(fullname, self) if new else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = new_name(spec.name)
        assert new is not None
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has just set the old name's spec on the module: give it back its own.
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder, which would load a second copy
