"""The .proto files a client in another language needs, shipped inside the package.

    python -m gym_grpc.protos DIR     # copy them into DIR, then: protoc -I DIR ...

`gym/v1/*.proto` is the protocol. The repository keeps it once, in proto/gym/v1:
a wheel carries it here as gym/v1 (setup.py maps the directory, as it maps the
bundled servers), and in a checkout (an editable install) it is read from proto/
itself. Beside it, as their projects publish them: `grpc/health/v1/health.proto`
and `grpc/reflection/v1/reflection.proto` (gRPC's grpc-proto), which every
server serves, and `google/rpc/status.proto` and `error_details.proto`
(googleapis), for the `google.rpc.BadRequest` detail an INVALID_ARGUMENT error
carries. The `google/protobuf/*.proto` files they import (struct, any, duration)
come with every protoc.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_HERE = Path(__file__).resolve().parent
#: The protoc -I root of the protocol's own files (gym/v1/...): this package in an installed
#: wheel, the repository's proto/ in a checkout.
GYM_ROOT = _HERE if (_HERE / "gym" / "v1").is_dir() else _HERE.parents[1] / "proto"


def _paths() -> dict[str, Path]:
    """Every shipped .proto by the name protoc imports it under, with where it is."""
    gym = sorted((GYM_ROOT / "gym" / "v1").glob("*.proto"))
    if not gym:
        raise FileNotFoundError(f"no gym/v1 .proto files in {_HERE} or {GYM_ROOT}: gym-grpc is not installed whole")
    found = {p.relative_to(_HERE).as_posix(): p for p in _HERE.rglob("*.proto")}
    return found | {p.relative_to(GYM_ROOT).as_posix(): p for p in gym}


def files() -> list[str]:
    """Every shipped .proto, as protoc imports it ("gym/v1/task.proto"), sorted."""
    return sorted(_paths())


def path(name: str) -> Path:
    """Where the shipped .proto `name` ("gym/v1/task.proto") is; KeyError for one not shipped."""
    return _paths()[name]


def copy_to(directory: Path) -> list[Path]:
    """Copy every shipped .proto into `directory` (created if need be), keeping the tree."""
    written = []
    for name, source in sorted(_paths().items()):
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        written.append(target)
    return written
