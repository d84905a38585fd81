#!/usr/bin/env bash
# Start N ranks of a command on this machine:
#   ./launch_distributed.sh 4 python train.py [args...]
# Sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR (default 127.0.0.1) and MASTER_PORT
# (default 29500, or a free port if that one is taken) for each rank, and a fresh job secret
# (CX_AUTH_TOKEN, unless you set one: README, "The job secret"), prefixes each
# output line with its rank, stops every rank if one fails, and exits non-zero then
# (CX_MAX_RESTARTS=N: starts them all again instead, up to N times, with RESTART_COUNT).
# The work is done by pycyxwiz's Python launcher (python -m pycyxwiz.launch --help).
set -euo pipefail
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ]; then
  echo "usage: $0 NUM_PROCESSES command [args...]   (e.g. $0 4 python train.py)" >&2
  exit 2
fi
n=$1
shift
# Run the launcher with the Python the command uses, so it sees the same packages.
py=${PYTHON:-}
if [ -z "$py" ]; then
  case "$(basename -- "$1")" in
    python|python3|python3.*) py=$1 ;;
    *) py=$(command -v python3 || command -v python) ;;
  esac
fi
exec "$py" -m pycyxwiz.launch --nproc-per-node "$n" -- "$@"
