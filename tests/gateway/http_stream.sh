#!/usr/bin/env bash
# Streams a chat completion with `curl -N` (no buffering) from the HTTP front at $1
# (model $2) and checks the server-sent events: data lines of JSON chunks, then [DONE].
set -euo pipefail
url=$1 model=$2
out=$(curl -sS -N --fail-with-body --max-time 30 "$url/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}],
       \"max_tokens\": 8, \"min_tokens\": 8, \"temperature\": 0, \"stream\": true}")
data=$(grep -c '^data: {' <<<"$out") || true
if (( data < 3 )); then echo "expected a role chunk and content chunks, got $data:"; echo "$out"; exit 1; fi
grep -q '"finish_reason":"length"' <<<"$out" || { echo "no finish_reason length:"; echo "$out"; exit 1; }
[[ $(grep '^data: ' <<<"$out" | tail -n 1) == "data: [DONE]" ]] || { echo "no [DONE] at the end:"; echo "$out"; exit 1; }
echo "ok: $data chunks"
