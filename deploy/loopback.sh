#!/usr/bin/env bash
# The whole secure corrflow deployment on one machine (127.0.0.1): key material, a SuperLink with TLS and
# SuperNode authentication, three registered SuperNodes running corrflow's ClientApp, and `flwr run` of the corrflow
# app (deploy/app) for a few rounds. The last line printed is the path of the privacy report.
#
#   deploy/loopback.sh [--workdir DIR] [--rounds N] [--client numpy|nextword] [--secagg [--noise-node]] [--drills]
#
# --workdir DIR  where keys, Flower homes, logs and the server's output go (default: a new temporary directory;
#                it is kept, so the report can be read afterwards)
# --rounds N     training rounds (default 3; every SuperNode trains in every round)
# --client NAME  numpy (default: the linear-regression task) or nextword: the next-word model on a small
#                StackOverflow-format SQLite file (`corrflow data generate`: 5 users, 3 in the train split, one
#                per SuperNode; the 2 held-out users are the server's evaluation set). Each SuperNode gets its own
#                copy of the file and of the vocabulary in DIR/nodes/<name>/ and its --node-config names them
#                (partition-id, num-partitions, data-path, vocab-path, from `corrflow data partition`'s manifest);
#                the run config selects corrflow.client="nextword" and gives the server its own copy for held-out
#                evaluation. The vocabulary is a PUBLIC word list (`corrflow data vocab --public`) counted from a
#                separately generated corpus (other users, other seed), so it spends no privacy budget and the
#                report says "public"; a differentially private vocabulary cannot be built from 3 users (no word
#                clears its threshold at ε = 1). The drill runs at ε = 32, δ = 1e-5, clip norm 0.25: a plumbing
#                check that 3 devices can train a private text model end to end, NOT a recommended setting.
#                Three devices barely learn at an ordinary ε (in process: ε = 8, clip norm 0.25 learned in 0 of 20
#                three-round runs; ε = 16, clip norm 0.1 in 80 of 80 runs with a thin margin); at these settings
#                the held-out loss fell in 160 of 160 simulations of 2 and 3 rounds. A run that does not
#                learn fails (`flwr ls`: finished:failed) and so does this script.
# --secagg       secure aggregation (SecAgg+): the SuperNodes clip and mask their updates, the server sees only
#                each round's sum (corrflow.secure-aggregation=true); the report must state the trust model
# --noise-node   with --secagg: a noise node (`corrflow noise-node`) as a fourth party, its own SuperNode with its own
#                registered key, its state in DIR/noise-node; it pins the run's recipe (planned from the same run
#                config), every SuperNode's --node-config pins its id and signed public key, and the server's run
#                config names it (corrflow.noise-node-pin). The server unmasks only noised sums and holds no noise key.
#                With --drills the noise node is also killed (SIGKILL) mid-round in the resumed run and restarted:
#                the round is redone with a fresh noise row, or the run stops and a third `flwr run` resumes it;
#                no noise row is ever sent twice (its journal), and the server's files hold no noise key
# --drills       also the failure drills: a fourth SuperNode with an unregistered key must be refused; after the
#                first checkpoint the ServerApp is killed (SIGKILL), SuperNode sn1 is restarted, and a second
#                `flwr run` must resume from the checkpoint with sn1 under the same identity
#
# Ports are free ports picked at start; every Flower process gets its own FLWR_HOME under the work directory.
# Every process started here runs in its own session and is stopped by its process id (with the processes it
# spawned) when the script exits, whether it succeeds or fails. Needs flwr and corrflow installed in the Python
# environment whose bin directory holds `flwr` on PATH (or FLWR_BIN=/path/to/venv/bin), plus openssl and
# ssh-keygen.
set -euo pipefail
export FLWR_TELEMETRY_ENABLED=0   # nothing leaves the machine

here=$(cd "$(dirname "$0")" && pwd)
workdir=""
rounds=3
drills=0
client=numpy
secagg=0
noise_node=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workdir) [[ $# -ge 2 ]] || { echo "loopback.sh: --workdir needs a directory" >&2; exit 2; }
               workdir="$2"; shift 2 ;;
    --rounds) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "loopback.sh: --rounds needs a positive integer" >&2; exit 2; }
              rounds="$2"; shift 2 ;;
    --client) [[ $# -ge 2 && ( "$2" == numpy || "$2" == nextword ) ]] || {
                echo "loopback.sh: --client needs numpy or nextword" >&2; exit 2; }
              client="$2"; shift 2 ;;
    --drills) drills=1; shift ;;
    --secagg) secagg=1; shift ;;
    --noise-node) noise_node=1; shift ;;
    -h|--help) awk 'NR >= 6 && /^# Ports/ {exit} NR >= 6 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "loopback.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ $noise_node -eq 1 && $secagg -eq 0 ]]; then
  echo "loopback.sh: --noise-node needs --secagg (the noise node adds its noise inside the secure sum)" >&2; exit 2
fi
if [[ $noise_node -eq 1 && $drills -eq 1 && $rounds -lt 3 ]]; then
  echo "loopback.sh: --noise-node --drills needs --rounds of at least 3 (the noise node is killed in round 2 or later)" >&2; exit 2
fi
if [[ $drills -eq 1 && $rounds -lt 2 ]]; then
  echo "loopback.sh: --drills needs --rounds of at least 2 (the server is killed after round 1)" >&2; exit 2
fi

bin="${FLWR_BIN:-$(dirname "$(command -v flwr || echo /nonexistent/flwr)")}"
[[ -x "$bin/flwr" && -x "$bin/flower-superlink" && -x "$bin/flower-supernode" ]] || {
  echo "loopback.sh: flwr, flower-superlink and flower-supernode not found (put the venv's bin on PATH or set FLWR_BIN)" >&2
  exit 2; }
export PATH="$bin:$PATH"   # Flower starts flower-superexec, flwr-serverapp and flwr-clientapp from PATH
py="$bin/python"
[[ -x "$py" ]] || py=python3
"$py" -c "import corrflow" 2>/dev/null || { echo "loopback.sh: corrflow is not importable by $py" >&2; exit 2; }

[[ -n "$workdir" ]] || workdir=$(mktemp -d "${TMPDIR:-/tmp}/corrflow-loopback.XXXXXX")
mkdir -p "$workdir"
workdir=$(cd "$workdir" && pwd)
logs="$workdir/logs"
mkdir -p "$logs" "$workdir/homes" "$workdir/superlink"
: >"$workdir/pids.txt"
out="$workdir/server"             # the ServerApp's output directory (persistent storage in a real deployment)
state="$out/state"

say() { printf '[loopback %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }

# -- processes: each in its own session, stopped by pid (with its descendants) on exit -------------------------
started=()
last_pid=""
launch() {  # launch NAME CMD...   (FLWR_HOME is NAME's own directory; output goes to logs/NAME.log)
  local name="$1"; shift
  mkdir -p "$workdir/homes/$name"
  FLWR_HOME="$workdir/homes/$name" setsid "$@" >>"$logs/$name.log" 2>&1 </dev/null &
  last_pid=$!
  started+=("$last_pid")
  echo "$last_pid $name" >>"$workdir/pids.txt"
}
descendants() {  # descendants PID: every live process below PID (Flower detaches its SuperExec into a new session)
  local frontier=("$1") next=() pid child
  local table
  table=$(ps -eo pid=,ppid=)
  while [[ ${#frontier[@]} -gt 0 ]]; do
    next=()
    for pid in "${frontier[@]}"; do
      while read -r child; do
        [[ -n "$child" ]] && { echo "$child"; next+=("$child"); }
      done < <(awk -v p="$pid" '$2 == p {print $1}' <<<"$table")
    done
    frontier=("${next[@]+"${next[@]}"}")
  done
}
stop_tree() {  # stop_tree PID: SIGTERM it (it shuts down its children), then what is left, SIGKILL after 15 s more
  local root="$1" pids=() p waited=0
  kill -0 "$root" 2>/dev/null || return 0
  mapfile -t pids < <(descendants "$root")
  pids=("$root" "${pids[@]+"${pids[@]}"}")
  kill -TERM "$root" 2>/dev/null || true
  while [[ $waited -lt 20 ]] && kill -0 "$root" 2>/dev/null; do sleep 0.5; waited=$((waited + 1)); done
  waited=0
  kill -TERM -- "-$root" 2>/dev/null || true
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  while [[ $waited -lt 30 ]]; do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && break
    sleep 0.5; waited=$((waited + 1))
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait "$root" 2>/dev/null || true
}
cleanup() {
  local rc=$? i run_id
  trap - EXIT INT TERM
  set +e  # the clean-up runs to its end and exits with the status that brought it here
  if [[ $rc -ne 0 && $rc -ne 130 && -n "${cli_home:-}" ]]; then
    # the ServerApps' own logs (what a round still waits for), while the SuperLink still serves them
    for run_id in "${run1:-}" "${run2:-}" "${run3:-}"; do
      [[ -n "$run_id" ]] || continue
      FLWR_HOME="$cli_home" timeout 30 "$bin/flwr" log "$run_id" loopback --show \
        >"$logs/serverapp-$run_id.log" 2>&1
    done
  fi
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do stop_tree "${started[$i]}"; done
  if [[ $rc -ne 0 ]]; then
    say "exit $rc; logs in $logs"
    for f in "$logs"/serverapp-*.log; do
      [[ -f "$f" ]] && { echo "--- corrflow in $f" >&2; { grep -E 'corrflow|round |WARNING|ERROR|still missing' "$f" || true; } | tail -n 15 >&2; }
    done
    [[ -f "$logs/superlink.log" ]] && { echo "--- tail of $logs/superlink.log" >&2; tail -n 25 "$logs/superlink.log" >&2; }
    for f in "$logs"/sn[123].log "$logs"/nn-supernode.log; do  # what each SuperNode received and answered, run by run
      [[ -f "$f" ]] && { echo "--- messages in $f" >&2; { grep -E 'RUN |Receiving|Sending|ERROR|Ignoring' "$f" || true; } | tail -n 30 >&2; }
    done
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.5 s
  local limit="$1" what="$2" start=$SECONDS; shift 2
  until "$@"; do
    [[ $((SECONDS - start)) -lt $limit ]] || die "timed out after ${limit} s waiting for $what"
    sleep 0.5
  done
}
in_log() { grep -q -- "$2" "$logs/$1.log" 2>/dev/null; }
exited() { ! kill -0 "$1" 2>/dev/null; }

# -- ports, keys, configuration ------------------------------------------------------------------------------
read -r link_port sn_port1 sn_port2 sn_port3 sn_port4 nn_port < <("$py" - <<'PY'
import socket
socks = []
for _ in range(6):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(*(s.getsockname()[1] for s in socks))
PY
)
sn_ports=("$sn_port1" "$sn_port2" "$sn_port3" "$sn_port4")
say "work directory $workdir; SuperLink on 127.0.0.1:$link_port"

pki="$workdir/pki"
extra_keys=()
[[ $noise_node -eq 1 ]] && extra_keys=(noise)
"$here/pki.sh" "$pki" sn1 sn2 sn3 rogue "${extra_keys[@]+"${extra_keys[@]}"}" >"$logs/pki.log"

cli_home="$workdir/homes/operator"
mkdir -p "$cli_home"
cat >"$cli_home/config.toml" <<TOML
[superlink]
default = "loopback"

[superlink.loopback]
address = "127.0.0.1:$link_port"
root-certificates = "$pki/ca.crt"
TOML
flwr_cli() { FLWR_HOME="$cli_home" "$bin/flwr" "$@"; }

# -- SuperLink -----------------------------------------------------------------------------------------------
launch superlink "$bin/flower-superlink" \
  --ssl-ca-certfile "$pki/ca.crt" --ssl-certfile "$pki/superlink.crt" --ssl-keyfile "$pki/superlink.key" \
  --enable-supernode-auth --disable-runtime-dependency-installation \
  --database "$workdir/superlink/state.db" --host 127.0.0.1 --port "$link_port"
superlink_pid=$last_pid
wait_for 120 "the SuperLink to listen" in_log superlink "Uvicorn running on https://127.0.0.1:$link_port"

# Register the three SuperNodes' public keys (the rogue key stays unregistered).
PATH="$bin:$PATH" FLWR_HOME="$cli_home" "$here/register.sh" loopback "$pki/supernodes/sn1.pub" \
  "$pki/supernodes/sn2.pub" "$pki/supernodes/sn3.pub" >"$workdir/registered.txt"
say "registered: $(tr '\n' ';' <"$workdir/registered.txt")"
if [[ $noise_node -eq 1 ]]; then
  PATH="$bin:$PATH" FLWR_HOME="$cli_home" "$here/register.sh" loopback "$pki/supernodes/noise.pub" \
    >"$workdir/noise-registered.txt"
  nn_id=$(awk '{print $2}' "$workdir/noise-registered.txt")
  say "registered the noise node's key: node id $nn_id"
fi

# -- the text task's data (--client nextword) ---------------------------------------------------------------
node_configs=()   # numpy: partition-id=i num-partitions=3
task_config=""
if [[ $client == nextword ]]; then
  data="$workdir/data"
  mkdir -p "$data"
  corrflow_cli() { "$py" -m corrflow.cli "$@"; }
  # The federated dataset (seed 2: 3 users in the train split, 2 held out) and, for the vocabulary, a public corpus
  # from the same generator with other users (seed 1000): counting it costs no privacy.
  corrflow_cli data generate stackoverflow --users 5 --seed 2 --out "$data/stackoverflow.sqlite" --quiet --json \
    >"$logs/data.log" 2>&1 || die "corrflow data generate failed (see $logs/data.log)"
  corrflow_cli data generate stackoverflow --users 200 --seed 1000 --out "$data/public-corpus.sqlite" --quiet \
    --json >>"$logs/data.log" 2>&1 || die "corrflow data generate (public corpus) failed (see $logs/data.log)"
  corrflow_cli data vocab "$data/public-corpus.sqlite" --public --size 50 --out "$data/vocab.txt" --json \
    >>"$logs/data.log" 2>&1 || die "corrflow data vocab failed (see $logs/data.log)"
  corrflow_cli data partition "$data/stackoverflow.sqlite" --out "$data/manifest.json" --json \
    >>"$logs/data.log" 2>&1 || die "corrflow data partition failed (see $logs/data.log)"
  # Each SuperNode holds its own copy of the file and the vocabulary; its node config is the manifest's line for
  # its partition with the data-path pointing at that copy, plus vocab-path.
  mapfile -t node_configs < <("$py" - "$data/manifest.json" "$workdir/nodes" <<'PY'
import json, shutil, sys
from pathlib import Path
from corrflow.data.partition import node_config
manifest, nodes = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
if manifest["num_partitions"] != 3:
    sys.exit(f"the dataset has {manifest['num_partitions']} train users, not one per SuperNode (3)")
source = Path(manifest["path"])
for part in manifest["partitions"]:
    home = nodes / f"sn{part['partition_id'] + 1}"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, home / source.name)
    shutil.copyfile(source.with_name("vocab.txt"), home / "vocab.txt")
    print(node_config(part["partition_id"], manifest["num_partitions"], home / source.name)
          + f" vocab-path='{(home / 'vocab.txt').resolve()}'")
PY
  ) || die "could not prepare the SuperNodes' data (see above)"
  [[ ${#node_configs[@]} -eq 3 ]] || die "expected 3 node configs, got ${#node_configs[@]}"
  task_config="corrflow.client=\"nextword\" corrflow.data-path=\"$data/stackoverflow.sqlite\""
  task_config+=" corrflow.vocab-path=\"$data/vocab.txt\" corrflow.target-epsilon=32.0 corrflow.clip-norm=0.25"
  say "nextword data: $data/stackoverflow.sqlite (3 train users, one per SuperNode), public vocabulary $data/vocab.txt"
fi

run_config="corrflow.num-users=3 corrflow.num-rounds=$rounds corrflow.epochs=$rounds corrflow.state-dir=\"$out\" corrflow.identity=\"node-key\"${task_config:+ $task_config}"
[[ $secagg -eq 1 ]] && run_config+=" corrflow.secure-aggregation=true"

# -- the noise node (--noise-node): pin the run's recipe, then its pin goes to every SuperNode and the server ----
node_pin=""
nn_dir="$workdir/noise-node"
if [[ $noise_node -eq 1 ]]; then
  run_config+=" corrflow.noise-node=true"
  "$py" -m corrflow.cli noise-node --dir "$nn_dir" --node-id "$nn_id" --app "$here/app" --run-config "$run_config" \
    --init-only --json >"$workdir/noise-pin.json" 2>"$logs/noise-node-init.log" \
    || die "corrflow noise-node --init-only failed (see $logs/noise-node-init.log)"
  node_pin=$("$py" -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["node_config"])' "$workdir/noise-pin.json")
  run_config+=" $("$py" -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["run_config"])' "$workdir/noise-pin.json" | sed 's/^corrflow.noise-node=true //')"
fi
nn_pid=""
start_noise_node() {  # the noise node's process; it starts its own SuperNode (log: logs/nn-supernode.log)
  launch nn "$py" -m corrflow.cli noise-node --dir "$nn_dir" --node-id "$nn_id" --app "$here/app" \
    --run-config "$run_config" --superlink "127.0.0.1:$link_port" --root-certificates "$pki/ca.crt" \
    --auth-supernode-private-key "$pki/supernodes/noise" --port "$nn_port" --flwr-bin "$bin" \
    --supernode-log "$logs/nn-supernode.log"
  nn_pid=$last_pid
}

# -- SuperNodes ----------------------------------------------------------------------------------------------
sn_pids=()
start_supernode() {  # start_supernode INDEX(0-based) NAME
  local i="$1" name="$2"
  launch "$name" "$bin/flower-supernode" --root-certificates "$pki/ca.crt" --superlink "127.0.0.1:$link_port" \
    --auth-supernode-private-key "$pki/supernodes/$name" --host 127.0.0.1 --port "${sn_ports[$i]}" \
    --node-config "${node_configs[$i]:-partition-id=$i num-partitions=3} user-id=\"$name\"${node_pin:+ $node_pin}"
  sn_pids[i]=$last_pid
}
for i in 0 1 2; do start_supernode "$i" "sn$((i + 1))"; done
for i in 1 2 3; do wait_for 120 "SuperNode sn$i to connect" in_log "sn$i" "SuperNode ID"; done
if [[ $noise_node -eq 1 ]]; then
  start_noise_node
  wait_for 120 "the noise node's SuperNode to connect" in_log nn-supernode "SuperNode ID"
  say "noise node $nn_id serving (state in $nn_dir)"
fi

if [[ $drills -eq 1 ]]; then
  start_supernode 3 rogue
  rogue_pid=$last_pid
  wait_for 120 "the unregistered SuperNode to be refused" exited "$rogue_pid"
  rogue_rc=0
  wait "$rogue_pid" || rogue_rc=$?
  [[ $rogue_rc -ne 0 ]] || die "the SuperNode with an unregistered key exited 0"
  in_log rogue "2004" || die "the unregistered SuperNode did not fail with Flower's code 2004"
  echo "rogue-exit-code $rogue_rc" >"$workdir/rogue.txt"
  say "unregistered SuperNode refused (exit code $rogue_rc, Flower error 2004)"
fi

# -- the corrflow run ----------------------------------------------------------------------------------------
submit() {  # submit LABEL: flwr run; prints the run id
  local answer
  answer=$(cd "$here/app" && flwr_cli run . loopback --run-config "$run_config" --format json 2>>"$logs/operator.log") \
    || die "flwr run failed: $answer"
  "$py" -c 'import json, sys; d = json.loads(sys.stdin.read()); print(d["run-id"]) if d.get("success") else sys.exit(d)' \
    <<<"$answer" || die "flwr run did not start a run: $answer"
}
checkpoint_round() {  # rounds completed according to the server's checkpoint (its manifest names round-NNNNNN)
  "$py" - "$state/checkpoint.zip" <<'PY' 2>/dev/null || echo 0
import json, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    print(int(json.loads(z.read("MANIFEST.json"))["checkpoint"].removeprefix("round-")))
PY
}
reached() { [[ $(checkpoint_round) -ge $1 ]]; }
run_status() { flwr_cli ls loopback --run-id "$1" --format json 2>/dev/null \
  | "$py" -c 'import json, sys; print(json.loads(sys.stdin.read())["runs"][0]["status"])' 2>/dev/null || echo unknown; }
wait_finished() {  # wait_finished RUN_ID: until Flower reports the run finished; fails unless it completed
  local run_id="$1" start=$SECONDS status
  while :; do
    status=$(run_status "$run_id")
    case "$status" in
      finished:completed) return 0 ;;
      finished:*) die "run $run_id ended with status $status (see: FLWR_HOME=$cli_home flwr log $run_id loopback)" ;;
    esac
    [[ $((SECONDS - start)) -lt 600 ]] || die "run $run_id did not finish within 600 s (status $status)"
    sleep 2
  done
}
answered() {  # answered NAME: the SuperNode replied to (or ignored) every message it received
  local got sent ignored
  got=$(grep -c 'Receiving: ' "$logs/$1.log" || true)
  sent=$(grep -c 'Sending: ' "$logs/$1.log" || true)
  ignored=$(grep -c 'Ignoring message' "$logs/$1.log" || true)
  [[ $got -le $((sent + ignored)) ]]
}
run_over() { [[ $(run_status "$1") == finished:* ]]; }
restart_supernode() {  # restart_supernode INDEX NAME: stop it and start it again under the same key until it connects
  local i="$1" name="$2" attempts=0 before start=$SECONDS
  stop_tree "${sn_pids[$i]}"
  # Flower refuses to activate a node it still believes online (code 2004) until two missed heartbeats (about
  # 60 s) when the old process did not deactivate on exit; like systemd's Restart=on-failure, start it again
  # until it connects.
  while :; do
    attempts=$((attempts + 1))
    echo "--- restart attempt $attempts" >>"$logs/$name.log"
    before=$(grep -c 'SuperNode ID' "$logs/$name.log" || true)
    start_supernode "$i" "$name"
    until [[ $(grep -c 'SuperNode ID' "$logs/$name.log" || true) -gt $before ]] || exited "${sn_pids[$i]}"; do
      sleep 0.5
    done
    [[ $(grep -c 'SuperNode ID' "$logs/$name.log" || true) -gt $before ]] && break
    wait "${sn_pids[$i]}" || true
    [[ $((SECONDS - start)) -lt 180 ]] || die "SuperNode $name could not reconnect within 180 s"
    sleep 5
  done
  say "SuperNode $name restarted (attempts: $attempts, $((SECONDS - start)) s)"
  echo "supernode-restart-attempts-$name $attempts" >>"$workdir/drills.txt"
}
restart_noise_node() {  # stop the noise node (SIGKILL with KILL=1) and start it again until its SuperNode connects
  local attempts=0 before start=$SECONDS p
  if [[ "${1:-}" == kill ]]; then
    for p in $(descendants "$nn_pid") "$nn_pid"; do kill -KILL "$p" 2>/dev/null || true; done
    wait "$nn_pid" 2>/dev/null || true
  else
    stop_tree "$nn_pid"
  fi
  while :; do  # as restart_supernode: Flower refuses the key (2004) until the old node is deemed offline
    attempts=$((attempts + 1))
    echo "--- restart attempt $attempts" >>"$logs/nn-supernode.log"
    before=$(grep -c 'SuperNode ID' "$logs/nn-supernode.log" || true)
    start_noise_node
    until [[ $(grep -c 'SuperNode ID' "$logs/nn-supernode.log" || true) -gt $before ]] || exited "$nn_pid"; do
      sleep 0.5
    done
    [[ $(grep -c 'SuperNode ID' "$logs/nn-supernode.log" || true) -gt $before ]] && break
    wait "$nn_pid" || true
    [[ $((SECONDS - start)) -lt 180 ]] || die "the noise node could not reconnect within 180 s"
    sleep 5
  done
  say "noise node restarted (attempts: $attempts, $((SECONDS - start)) s)"
  echo "noise-node-restart-attempts $attempts" >>"$workdir/drills.txt"
}
unstick() {  # unstick NAME...: restart each SuperNode still waiting for a reply in a run that ended (see below)
  local name i waited
  for name in "$@"; do
    waited=0
    until answered "$name" || [[ $waited -ge 90 ]]; do sleep 0.5; waited=$((waited + 1)); done
    answered "$name" && continue
    say "SuperNode $name still waits for a reply in an ended run"
    if [[ $name == nn-supernode ]]; then restart_noise_node; else i=$((${name#sn} - 1)); restart_supernode "$i" "$name"; fi
  done
}
journal_sends() { [[ -f "$nn_dir/journal.jsonl" ]] && wc -l <"$nn_dir/journal.jsonl" || echo 0; }
sent_beyond() { [[ $(journal_sends) -gt $1 ]]; }
serverapp_pid() {  # the flwr-serverapp process below the SuperLink (its SuperExec spawns it)
  local p
  for p in $(descendants "$superlink_pid"); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q 'flwr-serverapp' && { echo "$p"; return 0; }
  done
  return 1
}

run1=$(submit)
say "run $run1 submitted ($rounds rounds, state in $state)"
if [[ $drills -eq 1 ]]; then
  wait_for 300 "the first checkpoint" reached 1
  app_pid=$(serverapp_pid) || die "no flwr-serverapp process found below the SuperLink"
  kill -KILL "$app_pid"
  killed_at=$(checkpoint_round)
  # the rounds recorded so far (metrics.json is complete only every 10 rounds; the ledger log has every round)
  cp "$state/ledger.jsonl" "$workdir/ledger-at-kill.jsonl"
  [[ $killed_at -lt $rounds ]] || die "the run finished before the ServerApp could be killed"
  say "ServerApp (pid $app_pid) killed with SIGKILL after round $killed_at of $rounds"
  printf 'killed-after-round %s\nfirst-run %s\n' "$killed_at" "$run1" >"$workdir/drills.txt"
  flwr_cli stop "$run1" loopback >>"$logs/operator.log" 2>&1 || say "flwr stop $run1 answered an error (see logs/operator.log)"
  wait_for 120 "Flower to report run $run1 finished" run_over "$run1"
  # Restart SuperNode sn1 while the server is down: same key, so the same node id and corrflow identity.
  restart_supernode 0 sn1
  # Flower 1.42's SuperNode handles one message at a time and waits, without a limit, for the reply to each
  # message it pulled; when the run ends between the pull and the ClientApp's start, no reply ever comes and the
  # SuperNode serves no later run. An operator restarts such a node; so does this drill, for sn2 and sn3 when one
  # still holds an unanswered message of the killed run 45 s after Flower ended it.
  for i in 1 2; do
    name="sn$((i + 1))" waited=0
    until answered "$name" || [[ $waited -ge 90 ]]; do sleep 0.5; waited=$((waited + 1)); done
    answered "$name" || { say "SuperNode $name still waits for a reply in the killed run"; restart_supernode "$i" "$name"; }
  done
  [[ $noise_node -eq 1 ]] && unstick nn-supernode
  sends_before=$(journal_sends)
  run2=$(submit)
  say "run $run2 submitted: resumes from the checkpoint"
  echo "second-run $run2" >>"$workdir/drills.txt"
  if [[ $noise_node -eq 1 ]]; then
    # The noise node is killed (with its SuperNode) right after it sent a row of the resumed run: a later round
    # cannot be unmasked without it, so that round is redone with a fresh row or the run stops, nothing released.
    wait_for 300 "the noise node to send a row in run $run2" sent_beyond "$sends_before"
    restart_noise_node kill
    echo "noise-node-killed-after-sends $sends_before+" >>"$workdir/drills.txt"
    wait_for 900 "run $run2 to end" run_over "$run2"
    status=$(run_status "$run2")
    say "run $run2 ended $status after the noise node's kill"
    echo "noise-drill-status $status" >>"$workdir/drills.txt"
    if [[ $status != finished:completed ]]; then
      unstick sn1 sn2 sn3 nn-supernode
      run3=$(submit)
      say "run $run3 submitted: resumes from the checkpoint with the restarted noise node"
      echo "third-run $run3" >>"$workdir/drills.txt"
      wait_finished "$run3"
    fi
  else
    wait_finished "$run2"
  fi
else
  wait_finished "$run1"
fi

for run_id in "$run1" "${run2:-}" "${run3:-}"; do  # the ServerApps' logs, kept by the SuperLink
  [[ -n "$run_id" ]] && { flwr_cli log "$run_id" loopback --show >"$logs/serverapp-$run_id.log" 2>&1 || true; }
done

report="$out/privacy_report.json"
[[ -f "$report" ]] || die "no privacy report at $report"
done_rounds=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["rounds_completed"])' "$report")
[[ "$done_rounds" -eq "$rounds" ]] || die "the privacy report shows $done_rounds of $rounds rounds"
if [[ $client == nextword ]]; then
  say "$("$py" -c 'import json, sys; r = json.load(open(sys.argv[1]))["learning"]
print("nextword: held-out loss %.3f -> %.3f (learned: %s)" % (r["initial_test_loss"], r["final_test_loss"], r["learned"]))' \
    "$report")"
fi
if [[ $secagg -eq 1 ]]; then
  "$py" -c 'import json, sys; s = json.load(open(sys.argv[1])).get("secure_aggregation") or sys.exit(1)
print("secagg: the server saw " + s["server_saw"].split(";")[0])' "$report" >>"$workdir/secagg.txt" \
    || die "the privacy report of a --secagg run has no secure_aggregation section"
  say "$(cat "$workdir/secagg.txt")"
fi
if [[ $noise_node -eq 1 ]]; then
  # The noise node's report and the server's agree; no row was sent twice under one key segment; the server's
  # files (its run directory, the SuperLink's home and database) hold none of the noise node's keys.
  "$py" - "$report" "$nn_dir" "$rounds" "$out" "$workdir/homes/superlink" "$workdir/superlink" \
    >"$workdir/noise-node.txt" <<'PY' || die "the noise node's checks failed: $(cat "$workdir/noise-node.txt")"
import json, sys
from pathlib import Path
report, nn, rounds = json.load(open(sys.argv[1])), Path(sys.argv[2]), int(sys.argv[3])
mine = json.loads((nn / "noise_node_report.json").read_text())
server = report.get("noise_node") or sys.exit("the server's report has no noise_node section")
print("rounds-contributed", server["rounds_contributed"], mine["rounds_contributed"])
print("journal-head", server["journal_head"], mine["journal_head"])
sends = [json.loads(line) for line in (nn / "journal.jsonl").read_text().splitlines()]
pairs = [(e["round"], json.dumps(e["segment"], sort_keys=True)) for e in sends]
print("sends", len(sends), "repeated-rows", len(pairs) - len(set(pairs)))
keys = [bytes.fromhex(row[1]) for row in json.loads((nn / "keys.json").read_text())["segments"]]
found = [str(f) for root in sys.argv[4:] for f in Path(root).rglob("*") if f.is_file()
         for k in keys if k in f.read_bytes() or k.hex().encode() in f.read_bytes()]
print("key-segments", len(keys), "key-found-in-server-files", len(found), *found)
print("trust-model", "yes" if report.get("trust_model") else "no")
ok = (server["rounds_contributed"] == rounds and mine["rounds_contributed"] == rounds
      and server["journal_head"] == mine["journal_head"] and len(pairs) == len(set(pairs))
      and not found and report.get("trust_model"))
sys.exit(0 if ok else 1)
PY
  say "noise node: $(tr '\n' ';' <"$workdir/noise-node.txt")"
fi
with=""
[[ $secagg -eq 1 ]] && with=" and secure aggregation"
[[ $noise_node -eq 1 ]] && with+=" with a noise node"
say "done: $rounds rounds of the $client client over TLS with authenticated SuperNodes$with"
echo "$report"
