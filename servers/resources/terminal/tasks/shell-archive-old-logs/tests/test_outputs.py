import os
import sys
import tarfile
import unittest

LOGS = "/app/logs"
ARCHIVE = "/app/archive/logs-before-2024.tar.gz"
ARCHIVED = {
    "app/app-2023-11-01.log",
    "app/app-2023-12-15.log",
    "worker/worker-2023-10-10.log",
    "worker/retry queue.log",
    "nginx/error.log",
    "old-2023.log",
}
KEPT = {
    "app/app-2023-12-31.log",
    "app/app-2024-02-01.log",
    "worker/worker-2024-03-01.log",
    "worker/notes-2023-09-01.txt",
    "nginx/access.log",
    "nginx/access.log.1",
}


def content(rel):
    return f"log {rel}\nline 2 of {rel}\n".encode()


def norm(name):
    while name.startswith("./"):
        name = name[2:]
    return name


class ArchiveTest(unittest.TestCase):
    def test_archive_members(self):
        self.assertTrue(tarfile.is_tarfile(ARCHIVE))
        with tarfile.open(ARCHIVE, "r:gz") as tar:  # also proves it is gzip-compressed
            members = [m for m in tar.getmembers() if not m.isdir()]
            names = [norm(m.name) for m in members]
            self.assertEqual(sorted(names), sorted(ARCHIVED))
            for m in members:
                self.assertTrue(m.isfile(), m.name)
                self.assertEqual(tar.extractfile(m).read(), content(norm(m.name)))

    def test_logs_dir(self):
        present = set()
        for dirpath, _, files in os.walk(LOGS):
            for f in files:
                present.add(os.path.relpath(os.path.join(dirpath, f), LOGS))
        self.assertEqual(present, KEPT)
        for rel in KEPT:
            with open(os.path.join(LOGS, rel), "rb") as f:
                self.assertEqual(f.read(), content(rel), rel)


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
