#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import pathlib
p = pathlib.Path("textkit/slug.py")
src = p.read_text()
old = '    return re.sub(r"[^a-z0-9]", "-", text.lower())\n'
new = '    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")\n'
assert old in src
p.write_text(src.replace(old, new))
PY
python3 -m unittest discover -s tests
