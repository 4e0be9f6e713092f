#!/usr/bin/env python3
"""soak: a chaos soak of a real tandem cluster (issue 17; docs/reliability.md).

    soak.py --bin build/tandem --model MODEL [--seconds 60] [--seed 1] [--streams 4]

Starts a router (fixed gateway and control ports, so clients and nodes find a restarted
one) with 2 prefill and 2 decode nodes, one thread each, and keeps --streams greedy streams
running back to back (prompts of 2-40 ids, 16-48 tokens, each with a 20 s deadline) for
--seconds, while a controller, every 1.5-3 s, does one of: SIGKILL a node and start it
again under its id a moment later; SIGSTOP a node for 0.5-2.5 s then SIGCONT; start a new
node (up to 3 of a role); and once, half-way, SIGKILL the router and start a new one on its
ports. Then the load stops, the cluster quiesces, and the invariants are checked:

  - every request completed with exactly the ids `tandem generate` gives for its prompt, or
    ended with a status (never UNKNOWN, never without a message, never a client error)
    within its deadline plus 2 s;
  - after quiesce the router has no request in flight and every node is running and back
    to idle: no decode sequence running or waiting, no transfer lease, no KV block in use
    (decode and prefill), no prefill transfer in flight;
  - no process grew without bound: RSS is sampled every second; each process that lived
    10 s or more ends at most 1.5x (plus 32 MB, --rss-slack-mb) above its RSS a third into its life.

Prints the counts (requests, ok, failures by status, kills, stops, restarts, new nodes,
migrations, blocks in use after quiesce) and exits 0 when every invariant holds, 1 when
one does not. tests/soak/test_soak.sh runs a short soak in scripts/test.
"""
import argparse
import collections
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cluster"))
import grpc  # noqa: E402
from cluster_faults import fetch_metric  # noqa: E402
from cluster_wire import channel, generate_stub, parse_ids, request  # noqa: E402

DEADLINE_S = 20.0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def metric(url, name, label=""):
    """Sum of the series of NAME (matching LABEL 'k=v' when given), or None when the process
    does not answer or has no such series."""
    try:
        return fetch_metric(url, name, label)
    except Exception:
        return None


def rss_kb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Proc:
    """One cluster process, restartable under the same name and flags."""

    def __init__(self, soak, name, role, args):
        self.soak, self.name, self.role, self.args = soak, name, role, args
        self.p = None
        self.metrics = None
        self.stopped = False

    def start(self):
        log = open(os.path.join(self.soak.dir, self.name + ".log"), "ab")
        self.p = subprocess.Popen([self.soak.bin] + self.args, stdout=subprocess.PIPE, stderr=log)
        self.metrics = None
        deadline = time.monotonic() + 60
        pat = re.compile(r"^metrics: (\S+)" if self.role == "router" else r"^%s \S+: .* metrics (\S+)" % self.role)
        while time.monotonic() < deadline:
            line = self.p.stdout.readline().decode(errors="replace")
            if not line:
                raise RuntimeError("%s exited while starting (see %s.log)" % (self.name, self.name))
            m = pat.match(line)
            if m:
                self.metrics = m.group(1)
                break
        if not self.metrics:
            raise RuntimeError("%s did not print its metrics URL in 60 s" % self.name)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        p = self.p
        for _ in iter(p.stdout.readline, b""):
            pass

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            self.p.send_signal(sig)

    def kill(self):
        if self.alive():
            self.p.kill()
            self.p.wait()


class Soak:
    def __init__(self, a):
        self.a = a
        self.bin = os.path.abspath(a.bin)
        self.dir = tempfile.mkdtemp(prefix="tandem-soak-")
        self.rng = random.Random(a.seed)
        self.gw_port, self.ctl_port = free_port(), free_port()
        self.gateway = "127.0.0.1:%d" % self.gw_port
        self.procs = {}
        self.lock = threading.Lock()
        self.results = []
        self.events = collections.Counter()
        self.stop_load = threading.Event()
        self.rss = collections.defaultdict(list)  # (name, pid) -> [(t, kB)]
        # prompts and their references
        self.prompts = []
        for i in range(12):
            n = self.rng.randint(2, 40)
            ids = [1] + [self.rng.randint(3, 500) for _ in range(n - 1)]
            self.prompts.append((ids, self.rng.randint(16, 48)))
        self.refs = {}

    def node_args(self, role, nid):
        return [role, "--model", self.a.model, "--router", "127.0.0.1:%d" % self.ctl_port, "--node-id", nid,
                "--threads", "1", "--log-level", "warn"]

    def router_args(self):
        return ["router", "--port", str(self.gw_port), "--control-port", str(self.ctl_port), "--log-level", "warn",
                "--heartbeat-ms", "100", "--heartbeat-timeout-ms", "1000", "--lease-ms", "2000"]

    def add(self, name, role, args):
        p = Proc(self, name, role, args)
        p.start()
        self.procs[name] = p
        return p

    def reference(self, ids, max_tokens):
        out = subprocess.run([self.bin, "generate", "--model", self.a.model, "--prompt-ids", " ".join(map(str, ids)),
                              "--max-tokens", str(max_tokens), "--print-ids", "--threads", "1"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError("tandem generate failed: " + out.stderr[-300:])
        return [int(t) for t in out.stdout.split()]

    # ---- load -------------------------------------------------------------------------------
    def client(self, k):
        rng = random.Random(self.a.seed * 1000 + k)
        ch = channel(self.gateway)
        stub = generate_stub(ch)
        while not self.stop_load.is_set():
            i = rng.randrange(len(self.prompts))
            ids, max_tokens = self.prompts[i]
            t0 = time.monotonic()
            got, code, details = [], "OK", ""
            try:
                for m in stub(request(ids, max_tokens), timeout=DEADLINE_S):
                    got += parse_ids(m)
            except grpc.RpcError as e:
                code, details = e.code().name, e.details() or ""
            except Exception as e:  # a parse error is a failure of the test, never a hang
                code, details = "CLIENT_ERROR", repr(e)
            with self.lock:
                self.results.append((i, got, code, details, time.monotonic() - t0))
            if code == "UNAVAILABLE":
                time.sleep(0.05)  # the cluster is short of a pair a moment: do not spin
        ch.close()

    # ---- chaos ------------------------------------------------------------------------------
    def nodes(self, role=None):
        return [p for p in self.procs.values() if p.role != "router" and (role is None or p.role == role)]

    def chaos(self, end):
        router_restart_at = time.monotonic() + (end - time.monotonic()) / 2
        restarted_router = False
        n_new = collections.Counter()
        while time.monotonic() < end:
            time.sleep(self.rng.uniform(1.5, 3.0))
            if time.monotonic() >= end:
                break
            if not restarted_router and time.monotonic() >= router_restart_at:
                r = self.procs["router"]
                r.kill()
                self.events["router restarts"] += 1
                time.sleep(0.3)
                r.start()
                restarted_router = True
                continue
            action = self.rng.choice(["kill", "kill", "stop", "stop", "add"])
            if action == "add":
                role = self.rng.choice(["prefill", "decode"])
                if len(self.nodes(role)) < 3:
                    n_new[role] += 1
                    name = "%s-new%d" % (role[0], n_new[role])
                    self.add(name, role, self.node_args(role, name))
                    self.events["nodes added"] += 1
                    continue
                action = "kill"
            victim = self.rng.choice(self.nodes())
            if action == "kill":
                victim.kill()
                self.events["kills (%s)" % victim.role] += 1
                time.sleep(self.rng.uniform(0.2, 1.0))
                victim.start()
            else:
                victim.signal(signal.SIGSTOP)
                self.events["stops (%s)" % victim.role] += 1
                time.sleep(self.rng.uniform(0.5, 2.5))
                victim.signal(signal.SIGCONT)

    # ---- run --------------------------------------------------------------------------------
    def run(self):
        a = self.a
        bad = []
        try:
            for ids, max_tokens in self.prompts:
                self.refs[tuple(ids)] = self.reference(ids, max_tokens)
            self.add("router", "router", self.router_args())
            for role in ("prefill", "decode"):
                for k in range(2):
                    name = "%s%d" % (role[0], k)
                    self.add(name, role, self.node_args(role, name))
            time.sleep(1.0)
            t0 = time.monotonic()
            end = t0 + a.seconds
            clients = [threading.Thread(target=self.client, args=(k,), daemon=True) for k in range(a.streams)]
            for c in clients:
                c.start()

            threading.Thread(target=self.sample_rss, daemon=True).start()
            self.chaos(end)
            self.stop_load.set()
            for c in clients:
                c.join(DEADLINE_S + 5)
                if c.is_alive():
                    bad.append("a client did not end within its deadline after the load stopped")
            # every node back to work, then quiesce
            for p in self.procs.values():
                p.signal(signal.SIGCONT)
            time.sleep(3.0)
            bad += self.check_results()
            bad += self.check_idle()
            bad += self.check_rss()
        except Exception as e:
            bad.append("soak: %r" % e)
        finally:
            for p in self.procs.values():
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
            for p in self.procs.values():
                try:
                    p.p.wait(15)
                except Exception:
                    p.kill()
        for b in bad:
            print("FAIL: " + b)
        if bad:
            print("logs: %s" % self.dir)
        else:  # the logs are kept for a failure only
            shutil.rmtree(self.dir, ignore_errors=True)
        return 1 if bad else 0

    def check_results(self):
        bad = []
        codes = collections.Counter(r[2] for r in self.results)
        ok = codes.get("OK", 0)
        wrong = 0
        wrong_by = collections.Counter()
        for i, got, code, details, dt in self.results:
            ids, max_tokens = self.prompts[i]
            if code == "OK":
                if got != self.refs[tuple(ids)]:
                    wrong += 1
                    wrong_by[i] += 1
                    if wrong <= 3:
                        bad.append("prompt %d: got %s, tandem generate gives %s" % (i, got[:12], self.refs[tuple(ids)][:12]))
                continue
            if code in ("UNKNOWN", "CLIENT_ERROR") or not details:
                bad.append("a request ended %s without a clear status: %r" % (code, details[:200]))
            if dt > DEADLINE_S + 2:
                bad.append("a request ended %s after %.1f s, past its %g s deadline" % (code, dt, DEADLINE_S))
        migrations = metric(self.procs["router"].metrics, "tandem_router_migrations_total")
        print("requests: %d, ok %d (%d exact), failed %s" % (len(self.results), ok, ok - wrong,
              dict((c, n) for c, n in codes.items() if c != "OK")))
        print("chaos: %s; migrations (since the router's restart): %s" % (
              ", ".join("%s %d" % kv for kv in sorted(self.events.items())),
              "n/a" if migrations is None else int(migrations)))
        if wrong:
            bad.append("%d completed requests differ from tandem generate (by prompt: %s)" % (wrong, dict(wrong_by)))
        if ok < len(self.results) / 4:
            bad.append("fewer than a quarter of the requests completed (%d of %d)" % (ok, len(self.results)))
        return bad

    def check_idle(self):
        bad = []
        want = {"router": [("tandem_router_active_requests", 0)],
                "decode": [("tandem_decode_running_sequences", 0), ("tandem_decode_waiting_sequences", 0),
                           ("tandem_kvxfer_leases_live", 0), ("tandem_decode_kv_blocks_used", 0)],
                "prefill": [("tandem_kvxfer_transfers_inflight", 0), ("tandem_prefill_kv_blocks_used", 0)]}
        used_total = 0
        for p in self.procs.values():
            if not p.alive():
                bad.append("%s is not running at the end" % p.name)
                continue
            for name, v in want[p.role]:
                got = None
                for _ in range(100):
                    got = metric(p.metrics, name)
                    if got == v:
                        break
                    time.sleep(0.1)
                if got != v:
                    bad.append("%s: %s is %s after quiesce, not %s" % (p.name, name, got, v))
            if p.role in ("decode", "prefill"):
                used_total += int(metric(p.metrics, "tandem_%s_kv_blocks_used" % p.role) or 0)
        print("KV blocks in use after quiesce (leaked): %d" % used_total)
        return bad

    def sample_rss(self):
        """Every process's RSS every second while the load runs, by (name, pid): a restarted
        node is a new process with its own samples."""
        while not self.stop_load.is_set():
            now = time.monotonic()
            for p in list(self.procs.values()):
                if p.alive():
                    kb = rss_kb(p.p.pid)
                    if kb:
                        self.rss[(p.name, p.p.pid)].append((now, kb))
            time.sleep(1.0)

    def check_rss(self):
        """No process grew without bound: for each one that lived 10 s or more of the load,
        its last RSS sample is at most 1.5x (plus 32 MB) its sample a third into its life."""
        bad = []
        worst = None
        for (name, pid), samples in self.rss.items():
            if len(samples) < 2 or samples[-1][0] - samples[0][0] < 10:
                continue
            t0, t1 = samples[0][0], samples[-1][0]
            base = next(kb for t, kb in samples if t >= t0 + (t1 - t0) / 3)
            last = samples[-1][1]
            if worst is None or last - base > worst[3] - worst[2]:
                worst = (name, pid, base, last, t1 - t0)
            if last > 1.5 * base + self.a.rss_slack_mb * 1024:
                bad.append("%s (pid %d) grew from %d kB to %d kB over %.0f s" % (name, pid, base, last, t1 - t0))
        lived = sum(1 for s in self.rss.values() if len(s) >= 2 and s[-1][0] - s[0][0] >= 10)
        print("rss: %d processes lived 10 s or more; largest growth %s" % (lived, "none" if worst is None else
              "%s %d -> %d kB over %.0f s" % (worst[0], worst[2], worst[3], worst[4])))
        return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rss-slack-mb", type=int, default=32,
                    help="growth past 1.5x allowed (ASan's quarantine keeps up to 256 MB of freed memory)")
    sys.exit(Soak(ap.parse_args()).run())


if __name__ == "__main__":
    main()
