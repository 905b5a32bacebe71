#!/usr/bin/env bash
# The local stack for the `rlhf` flow's deployments, all on 127.0.0.1:
#   Prefect server + process work pool `rlhf-process` + one worker, a Ray head with its dashboard
#   (the Jobs API the stage tasks submit to), an MLflow tracking server; then it registers the
#   deployments of deployments/prefect.yaml.
#
#   deployments/stack.sh start    start everything and register the deployments (when all is up already:
#                                 only re-register; when part of an earlier stack runs: stop it, start afresh)
#   deployments/stack.sh stop     stop exactly the processes this stack started, remove stale state
#   deployments/stack.sh status   say what runs where
#
# State lives in ${RLHF_HOME:-<repo>/.rlhf}/stack/: stack.env (source it: PREFECT_API_URL,
# RAY_ADDRESS, MLFLOW_TRACKING_URI, ...), pids/, logs/, prefect/ (Prefect's database), mlflow/
# (SQLite store and artifacts), ray/ (Ray's temp dir). Ports are free ones picked at start.
# Optional: RLHF_ARTIFACT_ROOT=s3://bucket/prefix (+ AWS_ENDPOINT_URL and AWS credentials) puts
# MLflow artifacts on S3; RLHF_STACK_CPUS caps the Ray head's CPUs (default: all).
#
# Why not `ray stop`: it kills every Ray process on the machine (it has no address option), other
# people's clusters included (`--force` only makes it SIGKILL). This stack records the pids of its
# own Ray processes (those whose command line names its temp dir, and their descendants) and
# stops exactly those.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The venv's path as its processes show it: a symlinked .venv (a git worktree's) shows the target.
VENV_REAL="$(readlink -f "$REPO/.venv" 2>/dev/null || echo "$REPO/.venv")/"
BIN="$REPO/.venv/bin"
HOME_DIR="${RLHF_HOME:-$REPO/.rlhf}"  # a relative RLHF_HOME is taken from the caller's directory
mkdir -p "$HOME_DIR"
HOME_DIR="$(cd "$HOME_DIR" && pwd)"
cd "$REPO"  # `prefect deploy` runs from the repository root
STACK="$HOME_DIR/stack"
PIDS="$STACK/pids"
LOGS="$STACK/logs"
STATE="$STACK/state.env"   # ports and paths of the running stack (internal)
ENV_FILE="$STACK/stack.env"  # what users source
POOL="rlhf-process"
START_TIMEOUT="${RLHF_STACK_TIMEOUT:-120}"

# Ray's socket paths (<temp>/session_<date>_<pid>/sockets/plasma_store) must stay under 107 bytes.
RAY_TMP="$STACK/ray"
if [ "${#RAY_TMP}" -gt 40 ]; then
  RAY_TMP="/tmp/rlhf-ray-$(printf '%s' "$STACK" | md5sum | cut -c1-10)"
fi

log() { printf "[stack %3ds] %s\n" "$SECONDS" "$*"; }
die() { printf '[stack] error: %s\n' "$*" >&2; exit 1; }

[ -x "$BIN/prefect" ] && [ -x "$BIN/ray" ] && [ -x "$BIN/mlflow" ] ||
  die "$BIN has no prefect/ray/mlflow: install the project into $REPO/.venv first (pip install -e .)"

# A pid runs (a zombie, killed but not yet reaped by init, does not count).
alive() {
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
  [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
pid_of() { [ -f "$PIDS/$1.pid" ] && cat "$PIDS/$1.pid" || true; }

# N free TCP ports (free on all interfaces: Ray's services ignore the bind address), drawn from
# 20000-31999, below the kernel's ephemeral range and above Ray's default worker ports.
pick_ports() {
  "$BIN/python" - "$1" <<'EOF'
import random, socket, sys
n, chosen = int(sys.argv[1]), []
while len(chosen) < n:
    port = random.randrange(20000, 32000)
    if port in chosen:
        continue
    try:
        with socket.socket() as s:
            s.bind(("", port))
    except OSError:
        continue
    chosen.append(port)
print(" ".join(map(str, chosen)))
EOF
}

# wait_until SERVICE LOGFILE PID CHECK...: poll CHECK until it succeeds, the process dies or time runs out.
wait_until() {
  local service="$1" logfile="$2" pid="$3"; shift 3
  local deadline=$((SECONDS + START_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if [ -n "$pid" ] && ! alive "$pid"; then
      tail -n 20 "$logfile" >&2 || true
      die "$service exited during start; see $logfile"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 20 "$logfile" >&2 || true
      die "$service did not answer within ${START_TIMEOUT}s; see $logfile"
    fi
    sleep 1
  done
}

http_ok() { curl -fsS --max-time 5 "$@"; }

# Start a long-running command in the background, in its own process group (job control on:
# unlike plain `&` in a script, it keeps SIGINT, which the Prefect worker needs to stop cleanly).
launch() {
  local name="$1"; shift
  set -m
  nohup "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! >"$PIDS/$name.pid"
  set +m
}

# The members of process group $1 (a service started by `launch` leads its own group; its
# children stay in it even when the leader has died).
# Only processes run from this repository's venv count (a pid file may outlive its process).
# `ps -ww`: whole command lines, whatever COLUMNS says (set, ps cuts them to its width).
group_members() {
  ps -ww -eo pid=,pgid=,args= | VENV="$REPO/.venv/" REAL="$VENV_REAL" awk -v g="$1" \
    '$2 == g && $1 != g && (index($0, ENVIRON["VENV"]) || index($0, ENVIRON["REAL"])) { print $1 }'
}

# Is pid $1 still the service this stack started (its command line runs this venv's $2)?
is_service() {
  [ -r "/proc/$1/cmdline" ] && alive "$1" &&
    tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" | grep -qF "$BIN/$2"
}

# Every descendant of the given pids (found from ps's ppid column).
descendants() {
  ps -eo pid=,ppid= | awk -v roots=" $* " '
    { parent[$1] = $2; pids[NR] = $1 }
    END {
      n = split(roots, r, " "); for (i = 1; i <= n; i++) mark[r[i]] = 1
      changed = 1
      while (changed) { changed = 0
        for (i in pids) { p = pids[i]; if (!(p in mark) && (parent[p] in mark)) { mark[p] = 1; out[p] = 1; changed = 1 } } }
      for (p in out) print p
    }'
}

# The Ray processes this stack started: run from this venv with its temp dir on the command line,
# or the Ray client server of its GCS port. (The dashboard and runtime-env agents rename
# themselves `ray::...`; they are children of the raylet, found as descendants.) The patterns
# travel in the environment so that awk's own command line does not match.
ray_pids() {
  ps -ww -eo pid=,args= | RT="$RAY_TMP/" VENV="$REPO/.venv/" REAL="$VENV_REAL" GCS=":${RAY_GCS_PORT:-none} " \
    awk '{ pid = $1; args = $0; sub(/^ *[0-9]+ +/, "", args); args = args " " }
         ((index(args, ENVIRON["VENV"]) == 1 || index(args, ENVIRON["REAL"]) == 1) && index(args, ENVIRON["RT"])) ||
         (index(args, "ray.util.client.server") && index(args, ENVIRON["GCS"])) { print pid }'
}

# ray_pids plus all their descendants (recorded at start; the job agent's pid is among them).
ray_tree() { local r; r="$(ray_pids | tr '\n' ' ')"; [ -z "${r// /}" ] || echo $r $(descendants $r); }

# Is a recorded Ray pid still one of ours (not reused by something else since)?
still_ray() {
  local args
  [ -r "/proc/$1/cmdline" ] || return 1
  args="$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline")" || return 1
  case "$args" in
    *"$RAY_TMP/"* | "ray::"* | *ray.util.client.server*) return 0 ;;
    *) return 1 ;;
  esac
}

# stop_tree NAME SIGNAL GRACE "ROOTS" [MORE...]: send SIGNAL to ROOTS, SIGTERM to their
# descendants and MORE halfway through GRACE seconds, SIGKILL to whatever is left after it.
# Fails (naming them) when some survive even SIGKILL.
stop_tree() {
  local name="$1" sig="$2" grace="$3" roots="$4"; shift 4
  local all p left
  [ -n "${roots// /}${*// /}" ] || return 0
  all="$(echo $roots $* $(descendants $roots $*) | tr ' ' '\n' | sort -un | tr '\n' ' ')"
  for p in $all; do  # never this shell, its parent or init, whatever a pid file says
    case "$p" in 0 | 1 | "$$" | "$PPID") die "refusing to signal pid $p (bad pid file?)" ;; esac
  done
  log "stopping $name (pids $(echo $all | tr ' ' ','))"
  for p in $roots; do kill -s "$sig" "$p" 2>/dev/null || true; done
  local start=$SECONDS termed=""
  while [ $((SECONDS - start)) -lt "$grace" ]; do
    left=""
    for p in $all; do alive "$p" && left="$left $p"; done
    [ -z "$left" ] && return 0
    if [ -z "$termed" ] && [ $((2 * (SECONDS - start))) -ge "$grace" ]; then
      for p in $left; do kill -TERM "$p" 2>/dev/null || true; done
      termed=1
    fi
    sleep 0.5
  done
  for p in $all; do kill -KILL "$p" 2>/dev/null || true; done
  sleep 1
  left=""
  for p in $all; do alive "$p" && left="$left $p"; done
  if [ -n "$left" ]; then
    printf '[stack] %s: pids%s survived SIGKILL (uninterruptible I/O?)\n' "$name" "$left" >&2
    return 1
  fi
}

load_state() { if [ -f "$STATE" ]; then set -a; . "$STATE"; set +a; fi; }

prefect_env() {
  env PREFECT_HOME="$STACK/prefect" PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api" \
    PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_CLI_COLORS=false PREFECT_CLI_WRAP_LINES=false "$@"
}

# ---------------------------------------------------------------------------------------------

service_states() {
  # prints "name state" per service, state up|down
  local name binary
  for name in prefect-server prefect-worker mlflow; do
    binary="${name%%-*}"
    if is_service "$(pid_of "$name")" "$binary"; then echo "$name up"; else echo "$name down"; fi
  done
  if [ -f "$PIDS/ray.pids" ] && [ -n "${RAY_GCS_PORT:-}" ] && [ -n "$(ray_pids)" ]; then
    echo "ray up"
  else
    echo "ray down"
  fi
}

healthy() {
  [ -f "$STATE" ] || return 1
  load_state
  [ -z "$(service_states | awk '$2 == "down"')" ] || return 1
  http_ok "http://127.0.0.1:$PREFECT_PORT/api/health" >/dev/null && ui_reaches_api &&
    http_ok "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null &&
    ray_ready >/dev/null
}

cmd_status() {
  if [ ! -f "$STATE" ]; then log "not started (no $STATE)"; return 1; fi
  load_state
  service_states | while read -r name state; do log "$(printf '%-15s %s' "$name" "$state")"; done
  log "Prefect UI   http://127.0.0.1:$PREFECT_PORT"
  log "Ray dashboard http://127.0.0.1:$RAY_DASHBOARD_PORT"
  log "MLflow UI    http://127.0.0.1:$MLFLOW_PORT"
  log "environment  source $ENV_FILE"
  healthy
}

# stop_service NAME SIGNAL GRACE BINARY: a service started by `launch` leads its own process
# group; its group's members count as its tree too (they outlive a leader that was killed).
stop_service() {
  local name="$1" sig="$2" grace="$3" binary="$4" pid members
  pid="$(pid_of "$name")"
  [ -n "$pid" ] || return 0
  members="$(group_members "$pid" | tr '\n' ' ')"
  if is_service "$pid" "$binary"; then
    stop_tree "$name" "$sig" "$grace" "$pid" $members
  elif [ -n "${members// /}" ]; then
    stop_tree "$name (leftover processes)" TERM "$grace" "$members"
  fi
}

cmd_stop() {
  load_state
  local pid
  # The worker stops on SIGINT, not SIGTERM. A flow run still going (a child process) gets SIGTERM
  # halfway through the grace period, which stops its Ray job on the way out.
  local failed=""
  stop_service prefect-worker INT 30 prefect || failed="$failed prefect-worker"
  stop_service prefect-server TERM 10 prefect || failed="$failed prefect-server"
  stop_service mlflow TERM 10 mlflow || failed="$failed mlflow"
  local rp=""
  if [ -f "$PIDS/ray.pids" ]; then
    for pid in $(cat "$PIDS/ray.pids"); do still_ray "$pid" && rp="$rp $pid"; done
  fi
  rp="$(echo $rp $(ray_pids) | tr ' ' '\n' | sort -un | tr '\n' ' ')"
  if [ -n "${rp// /}" ]; then stop_tree ray TERM 6 "$rp" || failed="$failed ray"; fi
  # Pid files and state stay while something survives, so that the next stop finds it again.
  [ -z "$failed" ] || die "could not stop:$failed (see above); run '$0 stop' again, or kill them by hand"
  rm -rf "$PIDS" "$STATE" "$ENV_FILE" "$RAY_TMP"
  log "stopped"
}

start_ray() {
  local env_vars=(RLHF_HOME="$HOME_DIR" MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT"
    RLHF_JOB_COMMAND="$JOB_COMMAND" TORCH_EXTENSIONS_DIR="$TORCH_EXT" RAY_AUTH_MODE=token
    TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
    # On Linux Ray replaces a loopback --node-ip-address with the machine's address (and its
    # services then listen on all interfaces) unless this "cluster mode" is off: see local_ray.py.
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)
  local cpus=()
  [ -n "${RLHF_STACK_CPUS:-}" ] && cpus=(--num-cpus "$RLHF_STACK_CPUS")
  mkdir -p "$RAY_TMP"
  # Ray's token auth needs a token before `ray start`, which (unlike ray.init) does not make one:
  # on a machine that never ran Ray, make the default one as ray.init would. A RAY_AUTH_TOKEN_PATH
  # that names a missing file is the user's choice; Ray's own error then says what is wrong.
  if [ -z "$(ray_token)" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then
    log "no Ray auth token on this machine: generating ~/.ray/auth_token (ray get-auth-token --generate)"
    "$BIN/ray" get-auth-token --generate >/dev/null 2>>"$LOGS/ray.log" || die "could not generate a Ray auth token; see $LOGS/ray.log"
  fi
  log "starting Ray head (GCS 127.0.0.1:$RAY_GCS_PORT, dashboard :$RAY_DASHBOARD_PORT, temp dir $RAY_TMP)"
  if ! env -u RAY_ADDRESS "${env_vars[@]}" "$BIN/ray" start --head --node-ip-address 127.0.0.1 \
      --port "$RAY_GCS_PORT" --include-dashboard true --dashboard-host 127.0.0.1 \
      --dashboard-port "$RAY_DASHBOARD_PORT" --dashboard-agent-listen-port "$RAY_AGENT_PORT" \
      --dashboard-agent-grpc-port "$RAY_AGENT_GRPC_PORT" --runtime-env-agent-port "$RAY_RUNTIME_ENV_PORT" \
      --metrics-export-port "$RAY_METRICS_PORT" --node-manager-port "$RAY_NODE_MANAGER_PORT" \
      --object-manager-port "$RAY_OBJECT_MANAGER_PORT" --ray-client-server-port "$RAY_CLIENT_PORT" \
      --temp-dir "$RAY_TMP" --disable-usage-stats "${cpus[@]}" >>"$LOGS/ray.log" 2>&1; then
    ray_tree >"$PIDS/ray.pids"
    tail -n 20 "$LOGS/ray.log" >&2 || true
    die "Ray head failed to start; see $LOGS/ray.log"
  fi
  ray_tree >"$PIDS/ray.pids"
  [ -n "$(ray_token)" ] || die "Ray runs with token auth, but there is no token to call its Jobs API with: \
${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} is missing or unreadable (set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
  # A dashboard that refuses the token never accepts it: say so instead of waiting out the timeout.
  wait_until "Ray dashboard" "$LOGS/ray.log" "" dashboard_answers
  local code
  code="$(dashboard_code)"
  case "$code" in 401 | 403) die "Ray's dashboard refuses our auth token (HTTP $code): RAY_AUTH_TOKEN or \
RAY_AUTH_TOKEN_PATH is not the token this Ray head started with" ;; esac
  # Jobs can be submitted once the dashboard's Jobs API and the node's agent both answer.
  wait_until "Ray dashboard (Jobs API)" "$LOGS/ray.log" "" ray_ready
  ray_tree >"$PIDS/ray.pids"
}

# Ray's token auth (on by default since 2.60): the token Ray itself would use.
ray_token() {
  if [ -n "${RAY_AUTH_TOKEN:-}" ]; then echo "$RAY_AUTH_TOKEN"; else cat "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" 2>/dev/null || true; fi
}

# The HTTP status of the Jobs API with our token (000: no answer yet).
dashboard_code() {
  curl -s -o /dev/null -w '%{http_code}' --max-time 5 -H "Authorization: Bearer $(ray_token)" \
    "http://127.0.0.1:$RAY_DASHBOARD_PORT/api/jobs/" || true
}
dashboard_answers() { [ "$(dashboard_code)" != 000 ]; }

ray_ready() {
  local auth=(-H "Authorization: Bearer $(ray_token)")
  http_ok "${auth[@]}" "http://127.0.0.1:$RAY_DASHBOARD_PORT/api/jobs/" &&
    http_ok "${auth[@]}" "http://127.0.0.1:$RAY_AGENT_PORT/api/local_raylet_healthz"
}

cmd_start() {
  if healthy; then
    log "already running"
    register_deployments
    cmd_status || die "the stack stopped answering while its deployments were registered; see $LOGS"
    return 0
  fi
  if [ -f "$STATE" ] || [ -d "$PIDS" ]; then
    log "a previous stack is partly running or was not stopped cleanly: stopping it first"
    cmd_stop
  fi
  mkdir -p "$PIDS" "$LOGS" "$STACK/prefect" "$STACK/mlflow/artifacts"
  local ports
  read -r -a ports <<<"$(pick_ports 11)"
  JOB_COMMAND="$(printf '%q' "$BIN/python") -m rlhf_core.cli"
  TORCH_EXT="${TORCH_EXTENSIONS_DIR:-$HOME_DIR/torch_extensions}"
  ARTIFACTS="${RLHF_ARTIFACT_ROOT:-$STACK/mlflow/artifacts}"
  cat >"$STATE" <<EOF
PREFECT_PORT=${ports[0]}
MLFLOW_PORT=${ports[1]}
RAY_GCS_PORT=${ports[2]}
RAY_DASHBOARD_PORT=${ports[3]}
RAY_AGENT_PORT=${ports[4]}
RAY_AGENT_GRPC_PORT=${ports[5]}
RAY_RUNTIME_ENV_PORT=${ports[6]}
RAY_METRICS_PORT=${ports[7]}
RAY_NODE_MANAGER_PORT=${ports[8]}
RAY_OBJECT_MANAGER_PORT=${ports[9]}
RAY_CLIENT_PORT=${ports[10]}
RAY_TMP=$(printf '%q' "$RAY_TMP")
JOB_COMMAND=$(printf '%q' "$JOB_COMMAND")
TORCH_EXT=$(printf '%q' "$TORCH_EXT")
ARTIFACTS=$(printf '%q' "$ARTIFACTS")
EOF
  load_state

  # MLflow: SQLite store (the model registry needs a database) and proxied artifacts. Its job
  # runner (GenAI scoring: a dozen huey processes) is of no use here and costs two CPUs dearly.
  log "starting MLflow on 127.0.0.1:$MLFLOW_PORT (artifacts: $ARTIFACTS)"
  local mlflow_env=(MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false)
  if [ -n "${AWS_ENDPOINT_URL:-}" ]; then mlflow_env+=(MLFLOW_S3_ENDPOINT_URL="$AWS_ENDPOINT_URL"); fi
  launch mlflow env "${mlflow_env[@]}" "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" \
    --backend-store-uri "sqlite:///$STACK/mlflow/mlflow.db" --artifacts-destination "$ARTIFACTS" \
    --workers 1
  # Prefect server: its database lives under the stack; analytics off (offline machines).
  log "starting Prefect server on 127.0.0.1:$PREFECT_PORT"
  # The UI asks its API at PREFECT_UI_API_URL; unset, Prefect derives it from its default port (4200),
  # not from --port, and the UI of a stack on any other port showed "Can't connect to Server API".
  # No promotional content either: it is fetched from the internet, which the stack may not reach.
  # The V2 UI (Prefect's new one, its default from 3.8; 3.7, which the GPU profile resolves to for
  # vLLM 0.32's fastapi range, serves the old one unless asked): what docs/pipeline.md shows.
  launch prefect-server env PREFECT_HOME="$STACK/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_UI_API_URL="http://127.0.0.1:$PREFECT_PORT/api" PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT=false \
    PREFECT_SERVER_UI_V2_ENABLED="${PREFECT_SERVER_UI_V2_ENABLED:-true}" \
    "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" --analytics-off
  start_ray
  wait_until "MLflow server" "$LOGS/mlflow.log" "$(pid_of mlflow)" \
    http_ok "http://127.0.0.1:$MLFLOW_PORT/health"
  wait_until "Prefect server" "$LOGS/prefect-server.log" "$(pid_of prefect-server)" \
    http_ok "http://127.0.0.1:$PREFECT_PORT/api/health"
  ui_reaches_api || die "the Prefect UI on port $PREFECT_PORT is told another API address \
($(http_ok "http://127.0.0.1:$PREFECT_PORT/ui-settings")); is PREFECT_UI_API_URL set in a Prefect profile?"

  write_env_file
  # The worker creates the work pool (type process, Prefect's default job template) if missing.
  log "starting Prefect worker (work pool $POOL, one flow run at a time)"
  # Flow runs inherit the worker's environment: they submit to this Ray and log to this MLflow.
  (
    set -a; . "$ENV_FILE"; set +a
    export PREFECT_HOME="$STACK/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
    launch prefect-worker "$BIN/prefect" worker start --pool "$POOL" --type process \
      --name "rlhf-worker-$(hostname)-$PREFECT_PORT" --limit 1
  )
  wait_until "Prefect worker" "$LOGS/prefect-worker.log" "$(pid_of prefect-worker)" worker_online
  register_deployments
  cmd_status || die "every service answered during start, but not all of them now; see $LOGS"
  log "up; run: source $ENV_FILE"
}

# The UI of the stack's Prefect server asks its API where the server itself answers.
ui_reaches_api() {
  http_ok "http://127.0.0.1:$PREFECT_PORT/ui-settings" | grep -qF "\"api_url\":\"http://127.0.0.1:$PREFECT_PORT/api\""
}

worker_online() {
  http_ok -X POST -H 'Content-Type: application/json' -d '{}' \
    "http://127.0.0.1:$PREFECT_PORT/api/work_pools/$POOL/workers/filter" | grep -q '"status":"ONLINE"'
}

write_env_file() {
  {
    echo "# Source this file to use the stack started by deployments/stack.sh (written $(date -u +%FT%TZ))."
    echo "export RLHF_HOME=$(printf '%q' "$HOME_DIR")"
    echo "export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api"
    echo "export PREFECT_SERVER_ANALYTICS_ENABLED=false"
    echo "export RAY_ADDRESS=http://127.0.0.1:$RAY_DASHBOARD_PORT"
    echo "export RAY_AUTH_MODE=token"
    echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT"
    echo "export RLHF_JOB_COMMAND=$(printf '%q' "$JOB_COMMAND")"
    # One machine's Ray: a job's roles of one rank each stay in its driver where that node has no GPU
    echo "export RLHF_RANKS_ON_RAY=${RLHF_RANKS_ON_RAY:-0}"
    echo "export TORCH_EXTENSIONS_DIR=$(printf '%q' "$TORCH_EXT")"
    if [ -n "${RLHF_ARTIFACT_ROOT:-}" ]; then echo "export RLHF_ARTIFACT_ROOT=$(printf '%q' "$RLHF_ARTIFACT_ROOT")"; fi
    if [ -n "${AWS_ENDPOINT_URL:-}" ]; then echo "export AWS_ENDPOINT_URL=$(printf '%q' "$AWS_ENDPOINT_URL")"; fi
    echo "# UIs: Prefect http://127.0.0.1:$PREFECT_PORT  Ray http://127.0.0.1:$RAY_DASHBOARD_PORT  MLflow http://127.0.0.1:$MLFLOW_PORT"
  } >"$ENV_FILE"
}

register_deployments() {
  log "registering deployments (deployments/prefect.yaml)"
  prefect_env "$BIN/prefect" --no-prompt deploy --all --prefect-file "$REPO/deployments/prefect.yaml" \
    >>"$LOGS/prefect-deploy.log" 2>&1 ||
    { tail -n 30 "$LOGS/prefect-deploy.log" >&2; die "prefect deploy failed; see $LOGS/prefect-deploy.log"; }
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
