#!/bin/bash
# Builds /app/service: a repository with a fixed (deterministic) history.
set -euo pipefail
cd /app
git config --global user.name "Demo Developer"
git config --global user.email "dev@example.com"
git config --global init.defaultBranch main
mkdir service && cd service
git init -q -b main
n=0
commit() {  # $1 = message; commits everything with a fixed, increasing date
  n=$((n + 1))
  local d="2024-05-0${n}T12:00:00+00:00"
  git add -A
  GIT_AUTHOR_DATE="$d" GIT_COMMITTER_DATE="$d" git commit -q -m "$1"
}
printf 'REQUEST_TIMEOUT = 30\nMAX_RETRIES = 3\n' > settings.py
commit "Initial commit"
printf '# service\n\nSmall HTTP client service.\n' > README.md
commit "Add README"
printf 'import logging\n\nlog = logging.getLogger("service")\n' > logutil.py
commit "Add logging helper"
printf '# Notes\n\nTODO: try REQUEST_TIMEOUT = 45 if backends are slow\n' > NOTES.md
commit "Add notes"
printf 'REQUEST_TIMEOUT = 45\nMAX_RETRIES = 3\n' > settings.py
printf 'RETRY_BACKOFF = 2\n' >> settings.py
commit "Tune network settings"
printf 'REQUEST_TIMEOUT = 60\nMAX_RETRIES = 5\nRETRY_BACKOFF = 2\n' > settings.py
commit "Refactor settings"
printf '# service\n\nSmall HTTP client service with retries.\n' > README.md
commit "Update README"
