# Sourced by the `run:` of every task in this folder, on every node: joins this node to the task's
# own Ray cluster (head on SKYPILOT_NODE_RANK 0, the others its workers) and, on the head, exports
# RAY_ADDRESS for the `rlhf` command that follows.
#
# - Ports: SkyPilot's own Ray holds 6380, 8266 and the dashboard agent's 52365 on every node, so ours
#   takes Ray's defaults (GCS 6379, dashboard and Jobs API 8265) and agent port 52366, as SkyPilot's
#   sky_templates/ray/start_cluster does. The dashboard binds 127.0.0.1: only the head talks to it.
# - Token authentication (Ray 2.60's default): every node starts with the same RAY_AUTH_TOKEN, a
#   SkyPilot secret, so workers join and the Jobs API answers the head's pipeline.
# - Ray's processes inherit this shell's environment: the venv's `rlhf` on PATH (a stage job's
#   entrypoint is a shell on the cluster), the AWS secrets s3fs reads on every node, RLHF_HOME.
# - Stages wait in Ray's queue for the GPUs they ask for, so the head does not wait for workers.
# - A rerun on the same cluster (`sky exec`) finds this venv's raylet running and leaves Ray as it is.

source "$HOME/rlhf-venv/bin/activate"
export RLHF_HOME="$HOME/rlhf-home" RAY_AUTH_MODE=token
# the first line, without a pipe: under the tasks' `set -o pipefail`, `echo | head -n1` fails with
# SIGPIPE (exit 141) whenever head exits before echo has written (seen in the suite under load)
RAY_HEAD_IP=${SKYPILOT_NODE_IPS%%$'\n'*}
RAY_RUNNING_HERE=$(pgrep -f 'rlhf-venv/.*/raylet/raylet' || true)
if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
  if [ -z "$RAY_RUNNING_HERE" ]; then
    ray start --head --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265 \
      --dashboard-agent-listen-port=52366 --num-gpus="$SKYPILOT_NUM_GPUS_PER_NODE" --disable-usage-stats
  fi
  export RAY_ADDRESS=http://127.0.0.1:8265  # the Jobs API: `rlhf pipeline run` submits every stage here
else
  if [ -z "$RAY_RUNNING_HERE" ]; then
    until ray health-check --address="$RAY_HEAD_IP:6379" >/dev/null 2>&1; do sleep 2; done
    ray start --address="$RAY_HEAD_IP:6379" --dashboard-agent-listen-port=52366 \
      --num-gpus="$SKYPILOT_NUM_GPUS_PER_NODE" --disable-usage-stats
  fi
fi
