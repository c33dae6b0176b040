#!/bin/bash
# Builds /app/shop.db from shop.sql, then removes the SQL source.
set -euo pipefail
cd /app
sqlite3 shop.db < shop.sql
rm shop.sql
