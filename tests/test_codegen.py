"""The checked-in stubs are exactly what the pinned generator makes from proto/."""

from tests.support import REPO, script


def test_checked_in_stubs_match_a_fresh_generation():
    problems = script("dev/codegen.py", "codegen").check()
    assert not problems, "stale stubs, run `python dev/codegen.py`:\n" + "\n".join(problems)


def test_stubs_import_from_the_package_not_a_top_level_gym():
    for path in (REPO / "gym_grpc" / "v1").glob("*.py"):
        text = path.read_text()
        assert "from gym.v1 import" not in text, path.name
        assert "import gym.v1" not in text, path.name
