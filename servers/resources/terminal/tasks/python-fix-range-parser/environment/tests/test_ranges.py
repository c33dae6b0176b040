import unittest

from pagesel import parse_ranges


class ParseRangesTest(unittest.TestCase):
    def test_single_pages(self):
        self.assertEqual(parse_ranges("4,2"), [2, 4])

    def test_range_and_page(self):
        self.assertEqual(parse_ranges("1-3,5"), [1, 2, 3, 5])

    def test_reversed_range_rejected(self):
        with self.assertRaises(ValueError):
            parse_ranges("5-2")


if __name__ == "__main__":
    unittest.main()
