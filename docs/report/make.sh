#!/usr/bin/env bash
# Regenerates this directory: the quickstart's math tasks, 64 rollouts each, 64 at a time, collected at two
# temperatures from the embedded policy, then `gym-grpc report` on both side by side.
# Run from the repository's root: docs/report/make.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'kill -INT "$run" 2>/dev/null; wait "$run" 2>/dev/null; rm -rf "$work"' EXIT
gym-grpc run configs/quickstart.yaml --registry 127.0.0.1:0 > "$work/run.out" 2> "$work/run.log" &
run=$!
until grep -q "servers healthy" "$work/run.out"; do
    kill -0 "$run" || { cat "$work/run.log"; exit 1; }
    sleep 0.2
done
registry=$(awk '/^registry/ {print $2; exit}' "$work/run.out")
for temperature in 1.0 0.5; do
    gym-grpc collect --registry "$registry" --agent math_agent --input servers/resources/math/data/example.jsonl \
        --output "$work/math-temperature-$temperature.jsonl" --num-repeats 64 --max-in-flight 64 --no-progress \
        "temperature=$temperature" > /dev/null
done
cd "$work"
gym-grpc report math-temperature-1.0.jsonl math-temperature-0.5.jsonl --tasks \
    --png "$OLDPWD/docs/report" --html "$OLDPWD/docs/report/report.html" > "$OLDPWD/docs/report/report.txt"
