"""docs/changes.md keeps up with the protocol: a section for every version protocol.py declares,
and a row for every deprecated field the servers no longer write; docs/status.md names the version."""

from __future__ import annotations

import re
from pathlib import Path

import gym_grpc.rpc.protocol as protocol

REPO = Path(__file__).resolve().parent.parent
CHANGES = (REPO / "docs" / "changes.md").read_text()


def _declared() -> set[tuple[int, int]]:
    """The versions protocol.py's comments describe ("#: 1.4: ..."), and VERSION itself."""
    source = Path(protocol.__file__).read_text()
    found = {(int(a), int(b)) for a, b in re.findall(r"^#: (\d+)\.(\d+): ", source, re.M)}
    return found | {protocol.VERSION}


def test_the_changelog_has_a_section_for_every_protocol_version():
    sections = {(int(a), int(b)) for a, b in re.findall(r"^### (\d+)\.(\d+)\b", CHANGES, re.M)}
    declared = _declared()
    assert (1, 0) in declared and len(declared) > 2  # the comments were read
    assert sections == declared
    newest = re.search(r"^### (\d+)\.(\d+)\b", CHANGES, re.M)
    assert newest is not None and (int(newest[1]), int(newest[2])) == protocol.VERSION  # newest first


def test_the_changelog_names_every_unfilled_field_with_its_replacement_and_version():
    for name, field in protocol.UNFILLED.items():
        row = f"| `{name}` | `{field.instead}` | {field.since[0]}.{field.since[1]} "
        assert row in CHANGES, f"docs/changes.md has no row {row!r}"


def test_the_status_page_names_the_version_spoken():
    status = (REPO / "docs" / "status.md").read_text()
    named = re.search(r"The protocol is `gym\.v1`, version (\d+)\.(\d+)", status)
    assert named is not None, "docs/status.md no longer says which version the protocol is"
    assert (int(named[1]), int(named[2])) == protocol.VERSION
