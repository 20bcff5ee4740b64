#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice: every host runs the same `jaxalign train` (JAX multi-controller).
#
#   launch/tpu_pod.sh setup TPU_NAME ZONE            # install jax[tpu] + this checkout on every host
#   launch/tpu_pod.sh run   TPU_NAME ZONE -- --config launch/configs/llama3_8b_dpo_v5p.py [--config.X=Y ...]
#   launch/tpu_pod.sh logs  TPU_NAME ZONE            # copy every host's log to ./logs/TPU_NAME/
#   launch/tpu_pod.sh stop  TPU_NAME ZONE            # SIGTERM on every host: checkpoint, clean exit
#
# Environment: PROJECT (gcloud project, optional), RUN (a name for the log files; default: a timestamp),
# DRY_RUN=1 (print the gcloud commands instead of running them). See launch/README.md.
set -euo pipefail

usage() { sed -n '2,12p' "$0"; exit 2; }
[[ $# -ge 3 ]] || usage
action=$1 tpu=$2 zone=$3
shift 3
[[ ${1:-} == "--" ]] && shift

run=${RUN:-$(date +%Y%m%d-%H%M%S)}
remote_dir='~/jaxalign'
project_flag=()
[[ -n ${PROJECT:-} ]] && project_flag=(--project "$PROJECT")

gcloud_() {
  if [[ -n ${DRY_RUN:-} ]]; then
    printf '%q ' gcloud "$@"; echo
  else
    gcloud "$@"
  fi
}

on_all_workers() {  # the same command on every host of the slice, in parallel
  gcloud_ compute tpus tpu-vm ssh "$tpu" --zone "$zone" "${project_flag[@]}" --worker=all --command "$1"
}

case $action in
  setup)
    here=$(cd "$(dirname "$0")/.." && pwd)
    tarball=/tmp/jaxalign-src.tar.gz
    if [[ -z ${DRY_RUN:-} ]]; then
      git -C "$here" archive --format=tar.gz -o "$tarball" HEAD
    fi
    gcloud_ compute tpus tpu-vm scp "$tarball" "$tpu:/tmp/" --zone "$zone" "${project_flag[@]}" --worker=all
    on_all_workers "mkdir -p $remote_dir && tar -xzf /tmp/jaxalign-src.tar.gz -C $remote_dir && \
python3 -m pip install -q -U 'jax[tpu]' && python3 -m pip install -q -e $remote_dir"
    ;;
  run)
    [[ $# -ge 1 ]] || { echo "run: give the training arguments after --" >&2; exit 2; }
    args=$(printf '%q ' "$@")
    # nohup + background: the run survives the ssh session; each host writes its own log.
    on_all_workers "mkdir -p ~/jaxalign-logs && cd $remote_dir && \
nohup python3 -m jaxalign.cli train $args --config.logging.progress=False --config.distributed.mode=on \
> ~/jaxalign-logs/$run-\$(hostname).log 2>&1 < /dev/null &"
    echo "started run $run on every host of $tpu; follow it with: launch/tpu_pod.sh logs $tpu $zone"
    ;;
  logs)
    mkdir -p "logs/$tpu"
    gcloud_ compute tpus tpu-vm scp "$tpu:~/jaxalign-logs/*" "logs/$tpu/" --zone "$zone" "${project_flag[@]}" \
      --worker=all
    ;;
  stop)
    on_all_workers "pkill -TERM -f 'jaxalign.cli train' || true"
    ;;
  *) usage ;;
esac
