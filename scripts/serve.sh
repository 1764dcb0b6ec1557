#!/usr/bin/env bash
# `make serve`: environment, embedded model, a local Ray cluster with its dashboard, then
# `serve deploy serve_config.yaml`; waits until healthy and prints how to call it.
# `make stop` (scripts/stop.sh) ends exactly what this started.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

RAY_TMP="${BROWNOUT_RAY_TMP:-/tmp/brownout-ray-$(id -u)}"
DASHBOARD_PORT="${BROWNOUT_DASHBOARD_PORT:-8265}"
METRICS_PORT="${BROWNOUT_METRICS_PORT:-8080}"
HTTP_PORT=$(.venv/bin/python -c "import yaml;print(yaml.safe_load(open('serve_config.yaml'))['http_options']['port'])")
# Ray 2.60 turns on token auth for `ray start`; the CLI clients must be told to send the token.
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=token
DASH_URL="http://127.0.0.1:$DASHBOARD_PORT"

healthy() { curl -fsS --max-time 5 "http://127.0.0.1:$HTTP_PORT/healthz" >/dev/null 2>&1; }

# The token that the cluster, the CLI and `ray.init(address="auto")` share. On a machine that has
# never run Ray there is none, and `ray start` in token mode refuses to start without it. Ray's
# own default place (~/.ray/auth_token, mode 0600) is where every Ray client looks for it.
if ! .venv/bin/ray get-auth-token >/dev/null 2>&1; then
  echo "brownout: creating Ray's cluster token (~/.ray/auth_token)"
  .venv/bin/ray get-auth-token --generate >/dev/null
  chmod 600 "$HOME/.ray/auth_token" 2>/dev/null || true
fi

# The service's own secrets (serve_app/security.py): an API key for this machine's user and the
# admin token, each 0600 in a 0700 folder, created once. Only the key's hash is in the keys file.
read -r API_KEYS KEYS_FILE ADMIN_FILE < <(.venv/bin/python -c "
import yaml; a = yaml.safe_load(open('serve_config.yaml'))['applications'][0]['args'].get('auth', {})
print(a.get('api_keys', 'required'), a.get('keys_file', '~/.config/brownout/keys.yaml'),
      a.get('admin_token_file') or '-')")
KEYS_FILE="${KEYS_FILE/#\~/$HOME}"
ADMIN_FILE="${ADMIN_FILE/#\~/$HOME}"
KEY_FILE="$(dirname "$KEYS_FILE")/api_key"
if [ "$API_KEYS" = "disabled" ]; then
  echo "brownout: WARNING: auth.api_keys is 'disabled' in serve_config.yaml: anyone who reaches the port"
  echo "          is served, with no rate limit per key. For a local demo only."
elif [ ! -s "$KEY_FILE" ]; then
  .venv/bin/python -m serve_app.security add-key --file "$KEYS_FILE" --tenant local --tier standard \
    --id "local-$(id -un)" --key-out "$KEY_FILE" >/dev/null
  echo "brownout: created your API key (shown once here; kept in $KEY_FILE, 0600; its hash in $KEYS_FILE):"
  echo "          $(cat "$KEY_FILE")"
fi
if [ "$ADMIN_FILE" != "-" ] && [ ! -s "$ADMIN_FILE" ]; then
  echo "brownout: created the admin API's token (kept in $ADMIN_FILE, 0600):"
  echo "          $(.venv/bin/python -m serve_app.security admin-token --file "$ADMIN_FILE")"
fi

if .venv/bin/ray status --address "127.0.0.1:${BROWNOUT_GCS_PORT:-6380}" >/dev/null 2>&1 && healthy; then
  echo "brownout: already serving on http://127.0.0.1:$HTTP_PORT (left as it is; \`make stop\` ends it,"
  echo "          \`.venv/bin/serve deploy serve_config.yaml --address $DASH_URL\` applies a changed config)"
  exit 0
fi

echo "brownout: building the embedded tiny model (once; cached)"
.venv/bin/python -m deployments.tiny_model

if ! .venv/bin/ray status --address "127.0.0.1:${BROWNOUT_GCS_PORT:-6380}" >/dev/null 2>&1; then
  echo "brownout: starting a local Ray cluster (dashboard :$DASHBOARD_PORT, metrics :$METRICS_PORT)"
  # Every process of this cluster (Ray's daemons, its client server, replicas, vLLM's engine
  # processes) inherits this marker: `make stop` ends exactly those, by PID.
  export BROWNOUT_CLUSTER_ID="$RAY_TMP"
  .venv/bin/ray start --head --port "${BROWNOUT_GCS_PORT:-6380}" --num-cpus "$(nproc)" \
    --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" \
    --metrics-export-port "$METRICS_PORT" --temp-dir "$RAY_TMP" --disable-usage-stats >/dev/null
fi

echo "brownout: serve deploy serve_config.yaml"
.venv/bin/serve deploy serve_config.yaml --address "$DASH_URL"

echo -n "brownout: waiting for the app to be healthy"
for _ in $(seq 1 180); do
  if healthy; then echo " ok"; break; fi
  if .venv/bin/serve status --address "$DASH_URL" 2>/dev/null | grep -q DEPLOY_FAILED; then
    echo; .venv/bin/serve status --address "$DASH_URL"; exit 1
  fi
  echo -n .; sleep 2
done
healthy || { echo " not healthy after 6 min"; exit 1; }

cat <<MSG

Brownout is serving on http://127.0.0.1:$HTTP_PORT (Ray dashboard http://127.0.0.1:$DASHBOARD_PORT,
Prometheus metrics http://127.0.0.1:$METRICS_PORT/metrics).

Your API key is in $KEY_FILE (send it as 'Authorization: Bearer <key>'); the admin
API's token is in $ADMIN_FILE (send it as 'X-Brownout-Admin-Token: <token>').

  curl -s http://127.0.0.1:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -H "Authorization: Bearer \$(cat $KEY_FILE)" \\
    -d '{"model": "brownout-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

  .venv/bin/python - <<'PY'
  from pathlib import Path
  from openai import OpenAI
  key = Path("$KEY_FILE").read_text().strip()
  client = OpenAI(base_url="http://127.0.0.1:$HTTP_PORT/v1", api_key=key)
  for chunk in client.chat.completions.create(model="brownout-tiny", stream=True,
          messages=[{"role": "user", "content": "Hello!"}], max_tokens=32):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  print()
  PY

Stop it with: make stop
MSG
