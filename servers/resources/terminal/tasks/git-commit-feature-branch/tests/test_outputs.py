import subprocess
import sys
import unittest

REPO = "/app"
EXPECTED = "/tests/expected"
ORIGINAL_APP = 'def main():\n    print("Hello, world!")\n\n\nif __name__ == "__main__":\n    main()\n'
ORIGINAL_README = "# demo-app\n\nA tiny demo application.\n"


def git(*args):
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True, text=True).stdout


def expected(name):
    with open(f"{EXPECTED}/{name}") as f:
        return f.read()


class GitBranchCommitTest(unittest.TestCase):
    def test_branch_checked_out(self):
        self.assertEqual(git("symbolic-ref", "--short", "HEAD").strip(), "feature/greeting")

    def test_main_untouched(self):
        self.assertEqual(git("rev-list", "--count", "main").strip(), "2")
        self.assertEqual(git("log", "-1", "--format=%s", "main").strip(), "Add README")
        self.assertEqual(git("show", "main:app.py"), ORIGINAL_APP)
        self.assertEqual(git("show", "main:README.md"), ORIGINAL_README)
        self.assertNotIn("greet.py", git("ls-tree", "--name-only", "main").split())

    def test_single_new_commit(self):
        self.assertEqual(git("rev-list", "--count", "main..feature/greeting").strip(), "1")
        self.assertEqual(git("rev-list", "--count", "feature/greeting..main").strip(), "0")
        self.assertEqual(git("rev-parse", "feature/greeting^").strip(), git("rev-parse", "main").strip())
        self.assertEqual(git("log", "-1", "--format=%B", "feature/greeting").strip(), "Add greeting module")

    def test_commit_contents(self):
        files = sorted(git("ls-tree", "-r", "--name-only", "feature/greeting").split())
        self.assertEqual(files, [".gitignore", "README.md", "app.py", "greet.py"])
        for name in ["app.py", "greet.py", "README.md"]:
            with self.subTest(file=name):
                self.assertEqual(git("show", f"feature/greeting:{name}"), expected(name))

    def test_clean_worktree(self):
        self.assertEqual(git("status", "--porcelain"), "")


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
