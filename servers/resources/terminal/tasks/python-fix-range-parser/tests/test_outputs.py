import sys
import unittest

sys.path.insert(0, "/app")

from pagesel import parse_ranges  # noqa: E402


class HiddenParseRangesTest(unittest.TestCase):
    def test_visible_cases(self):
        self.assertEqual(parse_ranges("4,2"), [2, 4])
        self.assertEqual(parse_ranges("1-3,5"), [1, 2, 3, 5])

    def test_range_end_inclusive(self):
        self.assertEqual(parse_ranges("10-12"), [10, 11, 12])
        self.assertEqual(parse_ranges("9-10"), [9, 10])

    def test_single_page_range(self):
        self.assertEqual(parse_ranges("5-5"), [5])

    def test_spaces_and_overlap(self):
        self.assertEqual(parse_ranges(" 2 - 4 , 3-6 ,1"), [1, 2, 3, 4, 5, 6])

    def test_only_page(self):
        self.assertEqual(parse_ranges("7"), [7])

    def test_invalid(self):
        for bad in ["5-2", "0", "0-3", "abc", "1-", "", "1,,2"]:
            with self.subTest(spec=bad):
                with self.assertRaises(ValueError):
                    parse_ranges(bad)


if __name__ == "__main__":
    unittest.main()
