#!/bin/bash
# Builds the repository: two commits on main, then leaves staged, unstaged
# and untracked changes in the working tree.
set -euo pipefail
cd /app
git config --global user.name "Demo Developer"
git config --global user.email "dev@example.com"
git config --global init.defaultBranch main
export GIT_AUTHOR_DATE="2024-03-01T09:00:00+00:00" GIT_COMMITTER_DATE="2024-03-01T09:00:00+00:00"

mv gitignore .gitignore   # stored without the dot so it cannot affect the outer repo
stage=$(mktemp -d)
mv app.py README.md greet.py "$stage"/

cat > app.py <<'PY'
def main():
    print("Hello, world!")


if __name__ == "__main__":
    main()
PY
printf '# demo-app\n\nA tiny demo application.\n' > README.md

git init -q -b main
git add .gitignore app.py
git commit -q -m "Initial commit"
export GIT_AUTHOR_DATE="2024-03-02T09:00:00+00:00" GIT_COMMITTER_DATE="2024-03-02T09:00:00+00:00"
git add README.md
git commit -q -m "Add README"

mv "$stage"/app.py "$stage"/README.md "$stage"/greet.py .
rmdir "$stage"
echo "DEBUG local scratch output, must never be committed" > debug.log   # ignored
git add README.md          # staged change; app.py stays unstaged, greet.py untracked
