"""Regenerate the checked-in Python stubs of the gym.v1 protocol.

    python dev/codegen.py           # rewrite gym_grpc/v1 from proto/
    python dev/codegen.py --check   # exit 1 when it is stale

Configured by [tool.gym-grpc.codegen] in pyproject.toml. protoc writes imports
as `from gym.v1 import x_pb2` (the proto package); they are rewritten to the
Python package that holds the stubs, because a top-level `gym` package would
collide with OpenAI Gym. Nothing else in the generated text is touched.

Beside the stubs it writes `descriptor_set.binpb`: every .proto of the package
and every third-party one shipped in `shipped_protos` (health, reflection,
google.rpc), with the files they import, compiled with their source info, so
that server reflection can show the .proto comments (the descriptors inside
_pb2 modules have none). The package's .proto files themselves are not copied:
the wheel takes them from proto/ (setup.py maps proto/gym/v1 to
gym_grpc/protos/gym/v1), so the repository holds one copy.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import re
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INIT_TEXT = '"""Generated stubs of the gym.v1 protocol. Do not edit: run dev/codegen.py."""\n'
DESCRIPTOR_SET = "descriptor_set.binpb"


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["gym-grpc"]["codegen"]


def _check_tool_versions(cfg: dict) -> None:
    for dist in ("grpcio-tools", "mypy-protobuf"):
        want = cfg[dist]
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != want:
            sys.exit(f"codegen needs {dist}=={want} (found {have}); install the test extras: pip install -e '.[test]'")


def _plugin(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        sys.exit(f"codegen needs the protoc plugin {name} (from mypy-protobuf)")
    return found


def _shipped_root() -> Path:
    return ROOT / _config()["shipped_protos"]


def generate(out_dir: Path) -> None:
    """Generate the stubs and the descriptor set for every .proto of the package into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    cfg = _config()
    _check_tool_versions(cfg)
    proto_root = ROOT / cfg["proto_root"]
    protos = sorted((proto_root / cfg["proto_package"]).glob("*.proto"))
    messages = [str(p.relative_to(proto_root)) for p in protos]
    services = [m for m in messages if m.endswith("_service.proto")]
    shipped = _shipped_root()
    third_party = sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        base = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        ]
        runs = [
            base + [f"--python_out={tmp}", f"--mypy_out=quiet:{tmp}", *messages],
            base + [f"--grpc_python_out={tmp}", f"--mypy_grpc_out=quiet:{tmp}", *services],
            # The package's files come from proto/ (first on the path), the others from shipped_protos.
            base[:3]
            + [f"-I{shipped}", "--include_imports", "--include_source_info"]
            + [f"--descriptor_set_out={tmp}/{DESCRIPTOR_SET}"]
            + [*messages, *third_party],
        ]
        for args in runs:
            # protoc runs in-process; mypy-protobuf's plugin prints each file.
            if protoc.main(args) != 0:
                sys.exit(f"protoc failed: {' '.join(args)}")
        proto_pkg = cfg["proto_package"].replace("/", ".")
        py_pkg = cfg["python_package"]
        from_import = re.compile(rf"^from {re.escape(proto_pkg)} import ", re.M)
        module_ref = re.compile(rf"(?<![\w.]){re.escape(proto_pkg)}\.(\w+_pb2)\b")
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted((Path(tmp) / cfg["proto_package"]).iterdir()):
            text = src.read_text()
            text = from_import.sub(f"from {py_pkg} import ", text)
            text = module_ref.sub(rf"{py_pkg}.\1", text)
            (out_dir / src.name).write_text(text)
        (out_dir / "__init__.py").write_text(INIT_TEXT)
        shutil.copyfile(Path(tmp) / DESCRIPTOR_SET, out_dir / DESCRIPTOR_SET)


def _target() -> Path:
    return ROOT.joinpath(*_config()["python_package"].split("."))


def _snapshot(stubs: Path) -> dict[str, bytes]:
    """Every generated file by its name."""
    return {p.name: p.read_bytes() for p in sorted(stubs.glob("*")) if p.is_file()}


def check() -> list[str]:
    """Return a diff per stale file (empty when the checked-in stubs are fresh)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp) / "stubs")
        fresh = _snapshot(Path(tmp) / "stubs")
    current = _snapshot(_target())
    problems = []
    for name in sorted(fresh.keys() | current.keys()):
        if fresh.get(name) != current.get(name):
            if name.endswith(DESCRIPTOR_SET):
                problems.append(f"{name} differs")
                continue
            diff = difflib.unified_diff(
                current.get(name, b"").decode().splitlines(),
                fresh.get(name, b"").decode().splitlines(),
                f"checked-in/{name}",
                f"fresh/{name}",
                lineterm="",
                n=1,
            )
            problems.append("\n".join(list(diff)[:20]))
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the stubs are stale")
    args = parser.parse_args()
    if args.check:
        problems = check()
        if problems:
            print("\n\n".join(problems))
            sys.exit("stubs are stale: run python dev/codegen.py")
        print("stubs are fresh")
        return
    target = _target()
    if target.exists():
        shutil.rmtree(target)
    generate(target)
    print(f"wrote {target.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
