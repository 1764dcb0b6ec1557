#!/usr/bin/env bash
# The README's serve path, as a new user runs it, from an empty HOME (no ~/.ray, no
# ~/.cache/brownout; pip's download cache may be kept): `make serve`, the README's curl example,
# its openai SDK example, a streamed request that must end with `data: [DONE]`, then `make stop`,
# and a check that no process it started is left. One line per step with its time.
#
# The examples are not copies: they are read out of README.md (the fenced block that follows
# each `<!-- smoke: NAME -->` marker) and run as written, so a README that drifts fails here.
# Run by .ci/run after `make test`; by hand: `bash scripts/smoke.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

real_home="$HOME"
smoke_home=$(mktemp -d "${TMPDIR:-/tmp}/brownout-smoke-home.XXXXXX")
work=$(mktemp -d "${TMPDIR:-/tmp}/brownout-smoke.XXXXXX")
export HOME="$smoke_home"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$real_home/.cache/pip}"
HTTP_PORT=$(.venv/bin/python -c "import yaml;print(yaml.safe_load(open('serve_config.yaml'))['http_options']['port'])")
started=0

cleanup() {
  local rc=$?
  if [ "$started" = 1 ] && [ "$rc" != 0 ]; then
    make -s stop >/dev/null 2>&1 || true
  fi
  rm -rf "$smoke_home" "$work"
  exit "$rc"
}
trap cleanup EXIT

passed=0
step() {  # step NAME COMMAND...: run it, print "smoke: NAME ok  N.N s", or its log and fail
  local name=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  if "$@" >"$work/$name.log" 2>&1; then
    t1=$(date +%s.%N)
    passed=$((passed + 1))
    printf 'smoke: %-22s ok   %6.1f s\n' "$name" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')"
  else
    t1=$(date +%s.%N)
    printf 'smoke: %-22s FAILED after %.1f s; its output:\n' "$name" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')"
    tail -n 60 "$work/$name.log" | sed 's/^/    /'
    echo "smoke: $passed passed, 1 failed"
    return 1
  fi
}

readme_block() {  # the fenced block after `<!-- smoke: $1 -->` in README.md
  awk -v tag="<!-- smoke: $1 -->" '
    $0 == tag { want = 1; next }
    want && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }' README.md
}

# A process is ours if it runs with the smoke HOME in its environment (Ray's daemons, replicas
# and vLLM's engine processes all inherit it from `make serve`).
ours() {
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$pid" = "$$" ] && continue
    if tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qxF "HOME=$smoke_home"; then
      case "$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" in
        *smoke.sh*|"") ;;  # this script and its subshells
        *) echo "$pid $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | cut -c1-120)" ;;
      esac
    fi
  done
}

check_curl() {
  local out="$work/curl.out"
  bash -c "$(readme_block curl)" >"$out"
  head -n 1 "$out" | grep -q " 200" || { echo "expected HTTP 200:"; cat "$out"; return 1; }
  # the body is the last line of `curl -i`; its answer must be non-empty
  tail -n 1 "$out" | .venv/bin/python -c '
import json, sys
doc = json.load(sys.stdin)
text = doc["choices"][0]["message"]["content"]
assert text.strip(), f"empty answer: {doc}"
print("answer:", text[:60])'
}

check_sdk() {
  local out="$work/sdk.out"
  readme_block openai >"$work/sdk.py"
  [ -s "$work/sdk.py" ] || { echo "README has no openai example"; return 1; }
  (cd "$ROOT" && .venv/bin/python "$work/sdk.py") >"$out"
  grep -q '[^[:space:]]' "$out" || { echo "the SDK example printed no answer"; return 1; }
  cat "$out"
}

check_stream() {
  local out="$work/stream.out"
  curl -sS -N --max-time 120 "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" \
    -H 'Content-Type: application/json' -H "Authorization: Bearer $(cat "$HOME/.config/brownout/api_key")" \
    -d '{"model": "brownout-tiny", "stream": true, "max_tokens": 16,
         "messages": [{"role": "user", "content": "Tell me something."}]}' >"$out"
  grep -q '"content":"[^"]' "$out" || { echo "no content chunk:"; cat "$out"; return 1; }
  [ "$(grep -v '^$' "$out" | tail -n 1)" = "data: [DONE]" ] || { echo "stream did not end with [DONE]:"; tail -n 3 "$out"; return 1; }
}

check_closed() {
  # no key: 401; the admin API without its token: 401; with the README's token: 200
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" \
    -H 'Content-Type: application/json' -d '{"model": "brownout-tiny", "messages": [{"role": "user", "content": "x"}]}')
  [ "$code" = 401 ] || { echo "no API key: expected 401, got $code"; return 1; }
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP_PORT/admin/brownout")
  [ "$code" = 401 ] || { echo "admin API without token: expected 401, got $code"; return 1; }
  bash -c "$(readme_block admin)" | .venv/bin/python -c '
import json, sys
doc, _ = json.JSONDecoder().raw_decode(sys.stdin.read())
assert "level" in doc, doc
print("admin: level", doc["level"])'
}

check_second_serve() {
  make -s serve | tee "$work/serve2.out"
  grep -q "already serving" "$work/serve2.out"
}

check_actor() {
  readme_block actor >"$work/actor.py"
  [ -s "$work/actor.py" ] || { echo "README has no policy-actor example"; return 1; }
  (cd "$ROOT" && .venv/bin/python "$work/actor.py")
}

check_nothing_left() {
  local left
  for _ in $(seq 1 20); do
    left=$(ours)
    [ -z "$left" ] && return 0
    sleep 1
  done
  echo "processes started by make serve are still running:"; echo "$left"; return 1
}

echo "smoke: HOME is an empty folder; README serve path follows"
started=1
step "make serve" make -s serve
step "make serve (again)" check_second_serve
step "README curl" check_curl
step "README openai SDK" check_sdk
step "no key 401, admin closed" check_closed
step "streamed [DONE]" check_stream
step "README actor snippet" check_actor
step "make stop" make -s stop
started=0
step "nothing left running" check_nothing_left
echo "smoke: $passed passed, 0 failed"
