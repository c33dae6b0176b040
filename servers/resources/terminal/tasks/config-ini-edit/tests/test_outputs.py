import configparser
import re
import sys
import unittest

PATH = "/app/service.ini"
ORIGINAL = "/tests/original.ini"
KEY_RE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*=\s*(.*?)\s*$")


def norm(line):
    m = KEY_RE.match(line)
    return f"{m.group(1)} = {m.group(2)}" if m else line.rstrip()


class IniEditTest(unittest.TestCase):
    def setUp(self):
        with open(PATH) as f:
            self.text = f.read()
        self.cfg = configparser.ConfigParser(interpolation=None)
        self.cfg.read_string(self.text)

    def test_values(self):
        got = {s: dict(self.cfg[s]) for s in self.cfg.sections()}
        self.assertEqual(
            got,
            {
                "server": {"host": "0.0.0.0", "port": "8080", "timeout": "30", "workers": "4"},
                "database": {
                    "host": "db.internal",
                    "port": "5432",
                    "name": "orders",
                    "pool_size": "5",
                    "timeout": "60",
                    "ssl_mode": "require",
                },
                "logging": {"level": "DEBUG", "file": "/var/log/orders/service.log", "rotate": "daily"},
            },
        )

    def test_rest_of_file_preserved(self):
        with open(ORIGINAL) as f:
            orig = [norm(l) for l in f.read().splitlines()]
        # expected = original with the two changed values (in their sections)
        section, expected = None, []
        for line in orig:
            if line.startswith("["):
                section = line
            if section == "[database]" and line == "timeout = 30":
                line = "timeout = 60"
            if section == "[logging]" and line == "level = INFO":
                line = "level = DEBUG"
            expected.append(line)
        got = [norm(l) for l in self.text.splitlines()]
        self.assertEqual(sum(1 for l in got if l.startswith("ssl_mode =")), 1)
        got = [l for l in got if not l.startswith("ssl_mode =")]
        while got and got[-1] == "":
            got.pop()
        self.assertEqual(got, expected)


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
