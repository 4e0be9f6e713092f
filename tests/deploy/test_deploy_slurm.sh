#!/bin/bash
# test_deploy_slurm: deploy/slurm/tandem.sbatch on a real Slurm (Debian's slurm-wlm) started
# here on localhost: munged, slurmctld and slurmd with a minimal slurm.conf written in a temp
# dir (their own ports, state and sockets: nothing of a system Slurm is touched). The job
# (router, prefill and decode het groups, one task each, the test model) must print its
# gateway, serve a greedy request equal to `tandem generate`, and on scancel its nodes must
# drain (their log says so) and the job end within the bound. Skips visibly without slurm-wlm and munge, without
# root (slurmd), or when the daemons do not come up here. About 10 s.
set -u
SRC=$(cd "${TD_SOURCE_DIR:-$(dirname "$0")/../..}" && pwd)
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
M="${TANDEM_TEST_MODELS:-$SRC/../shared/models}/stories260K/stories260K.bin"
[ -f "$M" ] || { echo "skipped: $M absent (set TANDEM_TEST_MODELS)"; exit 77; }
for c in slurmctld slurmd munged mungekey sbatch squeue scancel scontrol sinfo; do
    command -v $c >/dev/null || [ -x /usr/sbin/$c ] ||
        { echo "skipped: $c not found (Debian packages slurm-wlm and munge: scripts/install-deps)"; exit 77; }
done
[ "$(id -u)" -eq 0 ] || { echo "skipped: slurmd must run as root"; exit 77; }
PATH=$PATH:/usr/sbin
T=$(mktemp -d)
PIDS=()
cleanup() {
    local p
    [ -n "${JOB:-}" ] && scancel "$JOB" 2>/dev/null
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    sleep 0.5
    for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT
skip() { echo "skipped: $*"; for f in "$T"/*.log; do [ -s "$f" ] && { echo "--- $f"; tail -n 5 "$f"; }; done; exit 77; }
fail=0
bad() { echo "FAIL: $*"; fail=1; }
# a free port: the kernel's pick, released at once (the daemons bind it a moment later)
port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

mkdir -p "$T/state" "$T/spool" "$T/munge"
chmod 700 "$T/munge"
mungekey --create --keyfile "$T/munge/munge.key" --bits 1024 >/dev/null 2>&1 || skip "mungekey failed"
munged --force --key-file "$T/munge/munge.key" --socket "$T/munge/sock" --pid-file "$T/munge/pid" \
    --log-file "$T/munged.log" --seed-file "$T/munge/seed" 2>>"$T/munged.log" || skip "munged did not start"
PIDS+=("$(cat "$T/munge/pid")")
HOST=$(hostname -s)
cat >"$T/slurm.conf" <<CONF
ClusterName=tandemtest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$(port)
SlurmdPort=$(port)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$T/munge/sock
CredType=cred/munge
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool/%n
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.%n.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=30
SchedulerType=sched/backfill
SchedulerParameters=enable_hetjob_steps,bf_interval=1
NodeName=n0 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(port) CPUs=4 RealMemory=2000 State=UNKNOWN
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(port) CPUs=4 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(port) CPUs=4 RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=n[0-2] Default=YES MaxTime=10 State=UP
CONF
export SLURM_CONF="$T/slurm.conf"
slurmctld -D -f "$SLURM_CONF" >>"$T/slurmctld.log" 2>&1 &
PIDS+=($!)
# three Slurm nodes on this host (slurmd -N, one port each): a het job's components do not
# share a node, so each group gets its own
for n in n0 n1 n2; do
    mkdir -p "$T/spool/$n"
    slurmd -D -f "$SLURM_CONF" -N $n >>"$T/slurmd.$n.out" 2>&1 &
    PIDS+=($!)
done
idle() { [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed)')" -eq 3 ]; }
for i in $(seq 100); do idle && break; sleep 0.2; done
idle || skip "slurmctld and 3 slurmd did not come up ($(sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' '))"
echo "slurm up: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"

# the job as shipped (2, 4 and 4 CPUs per group: each node claims 4), the model as TANDEM_MODEL
RUN="$T/run"
JOB=$(cd "$T" && TANDEM_BIN="$BIN" TANDEM_MODEL="$M" TANDEM_TOKENIZER= TANDEM_RUN_DIR="$RUN" TANDEM_GATEWAY_PORT=0 \
    TANDEM_HTTP_PORT=0 TANDEM_CONTROL_PORT=$(port) UCX_TLS=tcp UCX_NET_DEVICES=lo \
    TANDEM_PREFILL_FLAGS="--log-level info" TANDEM_DECODE_FLAGS="--log-level info" \
    sbatch --parsable --time=2 --output="$T/job.out" --error="$T/job.err" \
    "$SRC/deploy/slurm/tandem.sbatch" 2>"$T/sbatch.log") || skip "sbatch refused the job: $(cat "$T/sbatch.log")"
JOB=${JOB%%;*}
echo "job $JOB submitted"
for i in $(seq 300); do
    grep -q '^gateway: ' "$T/job.out" 2>/dev/null && break
    # still pending after 10 s: this Slurm cannot place it (not a fault of the script)
    [ "$i" -eq 50 ] && squeue -h -j "$JOB" -o '%T' 2>/dev/null | grep -q PENDING && break
    [ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] && break # the job ended
    sleep 0.2
done
if ! grep -q '^gateway: ' "$T/job.out" 2>/dev/null; then
    state=$(squeue -h -j "$JOB" -o '%T %r' 2>/dev/null)
    case $state in
    PENDING*) skip "the job stayed pending here: $state" ;;
    esac
    bad "no gateway line within 60 s (job: ${state:-gone}): $(tail -n 5 "$T/job.out" "$T/job.err" 2>/dev/null)"
else
    cat "$T/job.out"
    GW=$(sed -n 's/^gateway: //p' "$T/job.out")
    [ -s "$RUN/gateway" ] || bad "no gateway file in TANDEM_RUN_DIR"
    want=$("$BIN" generate --model "$M" --prompt-ids "1 45 12" --max-tokens 24 --print-ids --threads 1 2>/dev/null)
    got=$(timeout 30 "$BIN" generate --server "$GW" --prompt-ids "1 45 12" --max-tokens 24 --print-ids 2>"$T/gen.err")
    echo "through the job's gateway: $got"
    [ -n "$want" ] && [ "$got" = "$want" ] || bad "the job's cluster answered '$got', tandem generate '$want': $(cat "$T/gen.err")"
fi
t0=$(date +%s)
scancel "$JOB"
for i in $(seq 300); do [ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] && break; sleep 0.2; done
[ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] || bad "the job did not end within 60 s of scancel"
echo "job ended $(($(date +%s) - t0)) s after scancel"
JOB=
# Slurm's SIGTERM drained the nodes: each logged it (their stderr is the job's)
for role in prefill decode; do
    grep -E "^tandem: info: $role $role-[0-9]+-0: drained in" "$T/job.err" ||
        bad "the $role node did not log its drain on scancel: $(grep -E "$role" "$T/job.err" | tail -3)"
done
[ $fail -eq 0 ] || { for f in "$T"/job.err "$T"/slurmd.log; do echo "--- $f"; tail -n 15 "$f"; done; exit 1; }
echo "PASS: tandem.sbatch started router, prefill and decode as a heterogeneous job on a real Slurm, printed its gateway, served a request equal to tandem generate, and ended on scancel"
