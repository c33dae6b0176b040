import json
import sys
import unittest

EXPECTED = {
    "name": "inventory-api",
    "version": "2.3.1",
    "server": {
        "host": "0.0.0.0",
        "port": 9090,
        "cors_origins": ["https://app.example.com", "https://admin.example.com"],
    },
    "database": {
        "url": "postgres://db:5432/inventory",
        "pool": {"min": 2, "max": 50},
        "timeout_ms": 5000,
    },
    "features": {"enabled": ["search", "export", "metrics"], "beta": False},
}


class JsonEditTest(unittest.TestCase):
    def test_config(self):
        with open("/app/config.json") as f:
            got = json.load(f)
        # bool/int distinction: json.load keeps them apart, but True == 1 in
        # Python, so compare the canonical JSON text as well.
        self.assertEqual(got, EXPECTED)
        self.assertEqual(json.dumps(got, sort_keys=True), json.dumps(EXPECTED, sort_keys=True))


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
