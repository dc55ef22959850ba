#!/usr/bin/env bash
# Smoke test of the real TUI: runs `fleettui fleets/local.toml` in a detached tmux session at 140x45,
# waits for "ready", types a prompt, captures the pane to a text file and prints it, then quits with
# "Stop the fleet" and checks the app exited. Usage: tests/tui/tui_smoke.sh [OUTPUT.txt]
set -euo pipefail
cd "$(dirname "$0")/.."

OUTPUT=${1:-/tmp/fleettui-smoke.txt}
PROMPT=${PROMPT:-"What is the capital of France?"}
READY_TIMEOUT=${READY_TIMEOUT:-900}
REPLY_TIMEOUT=${REPLY_TIMEOUT:-300}
SESSION="fleettui-smoke-$$"
PYTHON=${PYTHON:-.venv/bin/python}

tmux new-session -d -s "$SESSION" -x 140 -y 45 \
    "$PYTHON -m fleettui fleets/local.toml --max-tokens 48; echo \"fleettui exited with \$?\"; sleep 30"
trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true' EXIT

capture() { tmux capture-pane -p -t "$SESSION"; }

wait_for() {  # wait_for PATTERN SECONDS
    local pattern=$1 seconds=$2
    for ((second = 0; second < seconds; second++)); do
        if capture | grep -q -- "$pattern"; then
            return 0
        fi
        sleep 1
    done
    echo "tui_smoke: no \"$pattern\" after ${seconds}s; the screen was:" >&2
    capture >&2
    return 1
}

wait_for "fleettui — ready" "$READY_TIMEOUT"
tmux send-keys -t "$SESSION" -l "$PROMPT"
tmux send-keys -t "$SESSION" Enter
wait_for "tok/s · acceptance" "$REPLY_TIMEOUT"
sleep 2  # one more telemetry redraw, so the fleet panel shows the tokens just served
capture > "$OUTPUT"
cat "$OUTPUT"

tmux send-keys -t "$SESSION" C-q
wait_for "Stop the fleet" 20
tmux send-keys -t "$SESSION" s
wait_for "fleettui exited with 0" 60
echo "tui_smoke: ok (screen saved to $OUTPUT)"
