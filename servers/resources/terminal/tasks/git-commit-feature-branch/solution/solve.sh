#!/bin/bash
set -euo pipefail
cd /app
git switch -c feature/greeting
git add -A
git commit -m "Add greeting module"
git status --porcelain
