import sys
import unittest

sys.path.insert(0, "/app")

from textkit import slugify  # noqa: E402


class HiddenSlugifyTest(unittest.TestCase):
    def test_visible_cases(self):
        self.assertEqual(slugify("Hello World"), "hello-world")
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_collapses_runs(self):
        self.assertEqual(slugify("a---b"), "a-b")
        self.assertEqual(slugify("one  /  two"), "one-two")
        self.assertEqual(slugify("x_y__z"), "x-y-z")

    def test_strips_edges(self):
        self.assertEqual(slugify("  padded text  "), "padded-text")
        self.assertEqual(slugify("--Already-Slug--"), "already-slug")
        self.assertEqual(slugify("!!!wow!!!"), "wow")

    def test_digits_kept(self):
        self.assertEqual(slugify("Top 10 Tips (2024)"), "top-10-tips-2024")

    def test_non_ascii_is_separator(self):
        self.assertEqual(slugify("Caf\u00e9 Cr\u00e8me"), "caf-cr-me")

    def test_no_alnum(self):
        self.assertEqual(slugify(""), "")
        self.assertEqual(slugify(" -- !! "), "")

    def test_unchanged_slug(self):
        self.assertEqual(slugify("already-a-slug"), "already-a-slug")


if __name__ == "__main__":
    unittest.main()
