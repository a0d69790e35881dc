#!/bin/bash
# usage: killrun.sh DIR STEP WORKER script args...   (kills WORKER by PID once a step >= STEP is logged)
dir=$1; step=$2; victim=$3; shift 3
rm -rf $dir && mkdir -p $dir && cd $dir
chameleon-ft run --nproc-per-node 4 --run-dir . "$@" > out.txt 2>&1 &
lp=$!
for i in $(seq 1 6000); do
  sleep 0.05
  [ -f events.jsonl ] && grep -q "\"event\":\"step\",.*\"step\":$step," events.jsonl && break
done
pid=$(grep "\"event\":\"run_start\",\"worker\":$victim," events.jsonl | sed 's/.*"pid":\([0-9]*\).*/\1/' | head -1)
sleep ${KILL_DELAY:-0}; kill -9 $pid && echo "killed worker $victim pid $pid at $(date +%T.%N)"
wait $lp; echo "launcher rc $?"
