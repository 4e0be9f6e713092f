#!/usr/bin/env bash
# test_prometheus: a real Prometheus (Debian's `prometheus`, scripts/install-deps) scrapes a
# real 1 prefill + 1 decode cluster (`tandem local` on stories260K) every second and answers
# every query of the Grafana dashboard (deploy/grafana/tandem-dashboard.json):
# - Prometheus runs as our own process: its own config and data dir in the test's temp
#   folder, 127.0.0.1 on a free port, stopped with the cluster (a system service, if the
#   Debian package started one, is neither used nor touched);
# - every tandem_* name in the dashboard's queries is one Prometheus scraped (no invented
#   metric), every target is up;
# - after `tandem bench serve` sends 30 requests, every panel query (with $__rate_interval
#   and $__interval set to 15s, $job to its All value) answers status success, and the
#   panels that must show the load answer non-empty and finite: request rate by outcome
#   (> 0), TTFT p50/p99, KV block occupancy, KV transfer bytes/s (> 0); the $job variable's
#   label_values query lists the jobs.
# Skips, saying so, where prometheus is not installed.
PROM=${PROMETHEUS:-prometheus}
if ! command -v "$PROM" >/dev/null 2>&1; then
    echo "skipped: $PROM is not installed (scripts/install-deps installs Debian's prometheus)"
    exit 77
fi
source "$(dirname "$0")/cluster_lib.sh"
DASH="$CL_SRC/deploy/grafana/tandem-dashboard.json"
cl_init
cl_local 1 1 --threads 1

# ---- our own Prometheus: one job per role, every process's /metrics, scraped each second ----
PORT=$("$CL_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
PROM_URL="http://127.0.0.1:$PORT"
{
    printf 'global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n'
    for role in router prefill decode; do
        printf '  - job_name: tandem_%s\n    metrics_path: /metrics\n    static_configs:\n      - targets: [' "$role"
        sep=
        for name in "${!CL_ROLE[@]}"; do
            [ "${CL_ROLE[$name]}" = "$role" ] || continue
            hp=${CL_MURL[$name]#http://}
            printf '%s"%s"' "$sep" "${hp%%/*}"
            sep=", "
        done
        printf ']\n'
    done
} >"$CL_T/prometheus.yml"
NT=${#CL_ROLE[@]}
echo "prometheus on $PROM_URL scraping $NT processes: ${CL_MURL[*]}"
mkdir -p "$CL_T/tsdb"
cl_spawn prometheus "$PROM" --config.file="$CL_T/prometheus.yml" --storage.tsdb.path="$CL_T/tsdb" \
    --web.listen-address="127.0.0.1:$PORT" --storage.tsdb.retention.time=1h --log.level=warn

# promql EXPR: the instant query's JSON answer
promql() {
    curl -s --max-time 5 --data-urlencode "query=$1" "$PROM_URL/api/v1/query"
}
# every target scraped at least twice (rate() needs two samples) before the load
ok=0
for ((i = 0; i < 150; i++)); do
    n=$(promql "count(count_over_time(up[1m]) >= 2 and up == 1)" 2>/dev/null |
        "$CL_PY" -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)' 2>/dev/null)
    [ "${n:-0}" = "$NT" ] && { ok=1; break; }
    sleep 0.1
done
[ $ok = 1 ] || { cl_fail "prometheus did not scrape all $NT targets twice within 15 s (got ${n:-none})"; cl_dump; cl_end; }

# ---- load: 30 requests through the gRPC gateway ----
if ! timeout 60 "$CL_BIN" bench serve --gateway "$CL_GW" --num-prompts 30 --request-rate 20 --input-len 24 \
        --output-len 16 --vocab-size 512 --max-concurrency 8 >"$CL_T/bs.out" 2>"$CL_T/bs.err"; then
    cl_fail "bench serve exited non-zero: $(tail -3 "$CL_T/bs.err")"
fi
grep -E '^Successful requests:' "$CL_T/bs.out"
sleep 3 # three scrapes after the last request

# ---- every panel query of the dashboard ----
"$CL_PY" - "$DASH" "$PROM_URL" <<'PY' || cl_fail "the dashboard's queries (above)"
import json, math, re, sys, urllib.parse, urllib.request
dash = json.load(open(sys.argv[1]))
url = sys.argv[2]
def get(path, **params):
    with urllib.request.urlopen(url + path + "?" + urllib.parse.urlencode(params), timeout=5) as r:
        return json.load(r)
# Grafana's variables: the interval ones, the datasource and each query variable's All value
subst = {"__rate_interval": "15s", "__interval": "15s", "__range": "15s"}
for v in dash["templating"]["list"]:
    if v["type"] == "query":
        subst[v["name"]] = v.get("allValue") or ".*"
def expand(e):
    return re.sub(r"\$\{?(\w+)\}?", lambda m: subst[m.group(1)], e)
# panels whose every query must answer data after the load: title -> positive too
must = {"Request rate by outcome": True, "Time to first token": False,
        "KV block occupancy (decode)": False, "KV transfer throughput": True}
names = set(get("/api/v1/label/__name__/values")["data"])
fail = 0
def bad(msg):
    global fail
    print("FAIL:", msg)
    fail = 1
titles = [p["title"] for p in dash["panels"]]
for t in must:
    if t not in titles:
        bad(f"no panel '{t}' in the dashboard")
# each query variable's label_values(METRIC, LABEL) lists some value (what Grafana offers)
for v in dash["templating"]["list"]:
    if v["type"] != "query":
        continue
    m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", v["definition"])
    if not m:
        bad(f"variable {v['name']}: cannot evaluate {v['definition']}")
        continue
    vals = get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": m.group(1)})["data"]
    print(f"variable {v['name']}: {vals}")
    if not vals:
        bad(f"variable {v['name']}: {v['definition']} lists nothing")
n = 0
for p in dash["panels"]:
    assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
    for t in p["targets"]:
        n += 1
        e = expand(t["expr"])
        for m in set(re.findall(r"\btandem_\w+", e)):
            if m not in names:
                bad(f"{p['title']}/{t['refId']}: {m} is not a metric Prometheus scraped")
        d = get("/api/v1/query", query=e)
        if d.get("status") != "success":
            bad(f"{p['title']}/{t['refId']}: {d}")
            continue
        res = d["data"]["result"]
        vals = [float(s["value"][1]) for s in res]
        print(f"{p['title']} / {t['legendFormat']}: {len(res)} series {[round(v, 6) for v in vals]}")
        if p["title"] in must:
            if not res:
                bad(f"{p['title']}/{t['refId']} answered no series after the load: {e}")
            elif not all(math.isfinite(v) for v in vals):
                bad(f"{p['title']}/{t['refId']} answered a value that is not finite: {vals}")
            elif must[p["title"]] and not sum(vals) > 0:
                bad(f"{p['title']}/{t['refId']} answered zero after the load: {vals}")
print(f"{n} queries of {len(dash['panels'])} panels evaluated")
sys.exit(fail)
PY
cl_kv_bytes_equal
cl_end "prometheus scraped the cluster and answered every dashboard query"
