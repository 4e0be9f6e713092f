#!/usr/bin/python3
"""replay.py: replays one group of the corpus tests/cluster/hostile/gen.py wrote (used by
tests/cluster/test_hostile_corpus.sh; stdlib, plus grpcio for the gRPC cases of the network group).

    replay.py model CORPUS TANDEM_BIN SAN_DIR
    replay.py flags CORPUS TANDEM_BIN SAN_DIR MODEL_DIR
    replay.py net CORPUS GATEWAY CONTROL[,CONTROL...] METRICS_URL[,METRICS_URL...]

model: each case through `tandem model info DIR` and `tandem generate --model DIR
--prompt-ids "1 2" --max-tokens 2`, each under `timeout 30`: it must exit 0 with output, or
exit 1 or 2 with an error line on stderr that names a file of the model (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) or the model directory (or, for
generate, the case's "message") and containing its "says"; a case the corpus marks "error" must
not load ("generate-error": generate must not). flags: each argument list through `tandem generate`: exit 2
with a message naming the flag. Both: no signal, no timeout, no sanitizer report (each case's
ASAN/UBSAN/LSAN log_path is SAN_DIR/<case>, checked after it). Cases run in parallel, one per
core.

net: each raw payload on its own connection to its target (the gateway, every control port or
every /metrics port): sent, the write side half-closed, then the server must close the
connection within 5 s (it may answer first); the gRPC bodies go through a stock grpcio client
and must end OK or with an error status that has a message (never UNKNOWN, UNAVAILABLE or a
deadline), and a normal request must be served after each target's cases.

Prints one summary line per group and each failure ("FAIL: ..."); exits 1 on any failure.
"""
import concurrent.futures as cf
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

FILES_RE = re.compile(r"config\.json|\.safetensors|tokenizer(_config)?\.json|tokenizer")
SAN_RE = re.compile(r"ERROR: (Address|Leak|Thread)Sanitizer|runtime error:|SUMMARY: \w+Sanitizer")


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def san_env(san_dir, tag):
    """The environment of one case: sanitizer reports to SAN_DIR/tag.<pid>."""
    env = dict(os.environ)
    log = os.path.join(san_dir, tag)
    for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
        opts = [o for o in env.get(var, "").split(":") if o and not o.startswith("log_path=")]
        env[var] = ":".join(opts + ["log_path=" + log])
    return env


def run(argv, san_dir, tag):
    """(rc, stdout, stderr, sanitizer report or "")."""
    p = subprocess.run(["timeout", "30"] + argv, capture_output=True, env=san_env(san_dir, tag))
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    report = ""
    for f in sorted(glob.glob(os.path.join(san_dir, tag + ".*"))):
        with open(f, errors="replace") as fh:
            report += fh.read()
    if SAN_RE.search(err):
        report += err
    return p.returncode, out, err, report


def verdict(rc, report, err):
    """None when the process ended on its own (not a signal, a timeout or a sanitizer report)."""
    if report:
        return "sanitizer report: %s" % "\n    ".join(report.strip().splitlines()[:12])
    if rc == 124:
        return "timed out (30 s)"
    if rc < 0 or rc >= 125:
        return "killed by a signal (exit %d): %s" % (rc, err.strip()[-300:])
    return None


def error_lines(err):
    return [l for l in err.splitlines() if "error" in l.lower() or l.startswith("tandem")]


def model_case(bin_, san_dir, i, case):
    """(kind, failure or None): kind is "error" (every command refused it clearly) or "loaded"."""
    d = case["dir"]
    cmds = [("model info", [bin_, "model", "info", d]),
            ("generate", [bin_, "generate", "--model", d, "--prompt-ids", "1 2", "--max-tokens", "2", "--threads", "1"])]
    kinds = []
    for what, argv in cmds:
        rc, out, err, report = run(argv, san_dir, "m%03d-%s" % (i, what.split()[-1]))
        bad = verdict(rc, report, err)
        if bad:
            return "fail", "%s %s: %s" % (what, case["name"], bad)
        if rc == 0:
            if not out.strip() and "generation:" not in err:
                return "fail", "%s %s: exit 0 without output" % (what, case["name"])
            if case["expect"] == "error" or (case["expect"] == "generate-error" and what == "generate"):
                return "fail", "%s %s: loaded a model that cannot be right (exit 0): %s" % (
                    what, case["name"], out.strip().splitlines()[:1])
            kinds.append("loaded")
            continue
        lines = error_lines(err)
        named = any(FILES_RE.search(l) or d in l for l in lines)
        allowed = what == "generate" and case.get("message") and any(case["message"] in l for l in lines)
        if rc not in (1, 2) or not lines or not (named or allowed):
            return "fail", "%s %s: exit %d with no error naming a file of the model: %r" % (
                what, case["name"], rc, err.strip()[-400:])
        if case.get("says") and not any(case["says"] in l for l in lines):
            return "fail", "%s %s: the error does not say %r: %r" % (what, case["name"], case["says"], lines[:2])
        kinds.append("error")
    return ("loaded" if kinds == ["loaded", "loaded"] else "error"), None


def flag_case(bin_, san_dir, model, i, case):
    argv = [bin_, "generate"] + [model if a == "MODEL" else a for a in case["args"]]
    rc, out, err, report = run(argv, san_dir, "f%03d" % i)
    bad = verdict(rc, report, err)
    if bad:
        return "fail", "generate %s: %s" % (case["name"], bad)
    if rc != 2:
        return "fail", "generate %s: exit %d, want 2 (usage error): %r" % (case["name"], rc, err.strip()[-300:])
    first = err.strip().splitlines()[:2]
    if not any(case["flag"] in l for l in first):
        return "fail", "generate %s: the message does not name %s: %r" % (case["name"], case["flag"], first)
    return "refused", None


def parallel(fn, cases, jobs):
    counts, fails = {}, []
    with cf.ThreadPoolExecutor(jobs) as ex:
        for kind, why in ex.map(lambda ic: fn(ic[0], ic[1]), enumerate(cases)):
            counts[kind] = counts.get(kind, 0) + 1
            if why:
                fails.append(why)
    for f in fails:
        print("FAIL: " + f)
    return counts, fails


# ---------------------------------------------------------------------------- network


def raw_case(addr, data, seconds=5.0, half_close=True):
    """(closed, bytes back): send, half-close (unless told not to), read until EOF or reset."""
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=seconds)
    got = 0
    try:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close before it read everything
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                b = s.recv(1 << 16)
            except (ConnectionResetError, BrokenPipeError):
                return True, got
            except socket.timeout:
                break
            if not b:
                return True, got
            got += len(b)
        return False, got
    finally:
        s.close()


def grpc_case(grpc, gateway, control, case):
    """(kind, failure or None) of one body sent through grpcio."""
    method, body = case["method"], bytes.fromhex(case["hex"])
    target = gateway if method.startswith("/tandem.v1.") else control
    ch = grpc.insecure_channel(target)
    try:
        if method.endswith("/Generate"):
            stub = ch.unary_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            list(stub(body, timeout=20))
        else:
            stub = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            stub(body, timeout=10)
        return "ok", None
    except grpc.RpcError as e:
        code, details = e.code().name, e.details() or ""
        if code in ("UNKNOWN", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED") or not details:
            return "fail", "grpc %s: %s %r: not a clear error" % (case["name"], code, details)
        return "status", None
    finally:
        ch.close()


def normal_ok(grpc, gateway):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from cluster_wire import parse_ids, request
    ch = grpc.insecure_channel(gateway)
    try:
        stub = ch.unary_stream("/tandem.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        got = []
        for m in stub(request([1, 7], 8), timeout=30):
            got += parse_ids(m)
        return None if len(got) == 8 else "a normal request gave %d tokens, not 8" % len(got)
    except grpc.RpcError as e:
        return "a normal request failed: %s %s" % (e.code().name, e.details())
    finally:
        ch.close()


def net_group(corpus, gateway, controls, metrics_urls):
    import grpc
    cases = load(os.path.join(corpus, "net.jsonl"))
    metrics = [u.split("//", 1)[1].split("/", 1)[0] for u in metrics_urls]
    targets = {"gateway": [gateway], "control": controls, "metrics": metrics}
    counts = {"cases": 0, "closed": 0, "answered": 0, "status": 0, "ok": 0, "deadline": 0}
    fails = []
    # the connections left open wait on the servers' deadlines (10 s) while the rest runs
    slow_ex = cf.ThreadPoolExecutor(16)
    slow = [(c, addr, slow_ex.submit(raw_case, addr, bytes.fromhex(c["hex"]), 15.0, False))
            for c in cases if c.get("left_open") for addr in targets[c["target"]]]
    for group in ("gateway", "control", "metrics", "grpc"):
        jobs = []
        with cf.ThreadPoolExecutor(16) as ex:
            for c in (c for c in cases if c["target"] == group and not c.get("left_open")):
                if group == "grpc":
                    jobs.append((c, "grpc", ex.submit(grpc_case, grpc, gateway, controls[0], c)))
                    continue
                for addr in targets[group]:
                    jobs.append((c, addr, ex.submit(raw_case, addr, bytes.fromhex(c["hex"]))))
            for c, addr, fut in jobs:
                counts["cases"] += 1
                try:
                    r = fut.result()
                except OSError as e:
                    fails.append("%s %s (%s): %r" % (group, c["name"], addr, e))
                    continue
                if group == "grpc":
                    kind, why = r
                    if why:
                        fails.append(why)
                    else:
                        counts[kind] += 1
                    continue
                closed, got = r
                if not closed:
                    fails.append("%s %s (%s): still open 5 s after the client half-closed (%d bytes back)" %
                                 (group, c["name"], addr, got))
                else:
                    counts["closed"] += 1
                    counts["answered"] += got > 0
        why = normal_ok(grpc, gateway)
        print("network %s: %d connections/calls so far; normal request after them: %s" %
              (group, counts["cases"], why or "ok"))
        if why:
            fails.append("after the %s cases: %s" % (group, why))
    for c, addr, fut in slow:
        counts["cases"] += 1
        closed, got = fut.result()
        if closed:
            counts["deadline"] += 1
        else:
            fails.append("%s (%s): not closed by the server's deadline within 15 s" % (c["name"], addr))
    slow_ex.shutdown()
    why = normal_ok(grpc, gateway)
    if why:
        fails.append("after the connections left open: %s" % why)
    for f in fails:
        print("FAIL: " + f)
    print("network: %d cases, %d closed by the server after the client's half-close (%d after answering), "
          "%d left open closed at the server's deadline, %d gRPC error statuses, %d gRPC OK, %d failures" %
          (counts["cases"], counts["closed"], counts["answered"], counts["deadline"], counts["status"], counts["ok"],
           len(fails)))
    return 1 if fails else 0


def main(argv):
    if len(argv) < 5:
        sys.exit(__doc__)
    group, corpus = argv[1], argv[2]
    jobs = max(2, os.cpu_count() or 2)
    if group == "model":
        bin_, san = argv[3], argv[4]
        os.makedirs(san, exist_ok=True)
        cases = load(os.path.join(corpus, "model.jsonl"))
        counts, fails = parallel(lambda i, c: model_case(bin_, san, i, c), cases, jobs)
        print("model files: %d cases, %d clear errors, %d loaded, %d failures" %
              (len(cases), counts.get("error", 0), counts.get("loaded", 0), len(fails)))
        return 1 if fails else 0
    if group == "flags":
        bin_, san, model = argv[3], argv[4], argv[5]
        os.makedirs(san, exist_ok=True)
        cases = load(os.path.join(corpus, "flags.jsonl"))
        counts, fails = parallel(lambda i, c: flag_case(bin_, san, model, i, c), cases, jobs)
        print("flags: %d cases, %d refused with exit 2 naming the flag, %d failures" %
              (len(cases), counts.get("refused", 0), len(fails)))
        return 1 if fails else 0
    if group == "net":
        return net_group(corpus, argv[3], argv[4].split(","), argv[5].split(","))
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
