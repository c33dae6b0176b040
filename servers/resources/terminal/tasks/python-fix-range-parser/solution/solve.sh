#!/bin/bash
set -euo pipefail
cd /app
sed -i 's/pages.update(range(start, end))/pages.update(range(start, end + 1))/' pagesel/ranges.py
grep -q 'range(start, end + 1)' pagesel/ranges.py
python3 -m unittest discover -s tests
