#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import csv
from collections import defaultdict
from decimal import Decimal

totals = defaultdict(Decimal)
with open("orders.csv", newline="") as f:
    for row in csv.DictReader(f):
        if row["status"] == "paid":
            totals[row["category"]] += int(row["quantity"]) * Decimal(row["unit_price"])
with open("revenue.csv", "w") as out:
    out.write("category,revenue\n")
    for cat, total in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])):
        out.write(f"{cat},{total:.2f}\n")
PY
cat revenue.csv
