#!/usr/bin/env bash
# `make stop`: shut down the Serve app and the Ray cluster that `make serve` started, by PID.
# Only this cluster's processes (see `marked` below) and their descendants are ended: other Ray
# clusters on the machine are left alone (`ray stop` would end them all).
set -uo pipefail
cd "$(dirname "$0")/.."
RAY_TMP="${BROWNOUT_RAY_TMP:-/tmp/brownout-ray-$(id -u)}"
DASHBOARD_PORT="${BROWNOUT_DASHBOARD_PORT:-8265}"
export RAY_AUTH_MODE=token
.venv/bin/serve shutdown -y --address "http://127.0.0.1:$DASHBOARD_PORT" >/dev/null 2>&1 || true

# Ours: processes that carry serve.sh's marker in their environment (all of the cluster's,
# including Ray's client server, whose command line does not name the temp dir), or whose
# command line names the temp dir (a cluster started before the marker existed).
marked() {
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$pid" = "$$" ] && continue
    tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qxF "BROWNOUT_CLUSTER_ID=$RAY_TMP" && echo "$pid"
  done
  return 0
}
roots=$( (marked; ps -eo pid=,args= | awk -v t="$RAY_TMP" 'index($0, t) && !/awk/ {print $1}') | sort -u)
if [ -z "$roots" ]; then echo "brownout: nothing to stop"; exit 0; fi
# the roots and every descendant of theirs
pids=$(ps -eo pid=,ppid= | awk -v roots="$roots" '
  BEGIN { n = split(roots, r, /[ \n]+/); for (i = 1; i <= n; i++) if (r[i] != "") keep[r[i]] = 1 }
  { parent[$1] = $2 }
  END { changed = 1
        while (changed) { changed = 0
          for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 } }
        for (p in keep) print p }')
pids=$(echo $pids)
echo "brownout: stopping Ray processes $pids"
kill $pids 2>/dev/null || true
for _ in $(seq 1 20); do
  alive=$(for p in $pids; do kill -0 "$p" 2>/dev/null && echo "$p"; done)
  [ -z "$alive" ] && break
  sleep 0.5
done
[ -n "${alive:-}" ] && kill -9 $alive 2>/dev/null
echo "brownout: stopped"
