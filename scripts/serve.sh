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

  curl -s http://127.0.0.1:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "brownout-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

  .venv/bin/python - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:$HTTP_PORT/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="brownout-tiny", stream=True,
          messages=[{"role": "user", "content": "Hello!"}], max_tokens=32):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  print()
  PY

Stop it with: make stop
MSG
