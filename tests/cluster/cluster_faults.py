"""cluster_faults: the client side of the cluster fault tests (tests/test_cluster_*.sh).

A stock grpcio client (messages built by hand from proto/tandem.proto's field numbers, so no
generated stubs) plus raw sockets. Each subcommand checks one behaviour, prints what it saw
and exits 0 when the behaviour is right, 1 (with 'FAIL: why' lines) when not:

  metric URL NAME [LABEL=VALUE]          print a /metrics value (sum of the matching series)
  waitmetric URL NAME OP VALUE SECONDS   wait until the value OP (== <= >=) VALUE holds
  looplag BOUND_S NAME=URL...            each process's event-loop lag p99 is under BOUND_S
  bigprompt TARGET BYTES OUT             one Generate of a BYTES-letter text prompt; 'CODE details' to OUT
  cancel HOST:PORT N MAX_TOKENS AFTER [URL]
                                         N streams, each cancelled once it has AFTER tokens (0:
                                         at its first message); URL: print the decode node's
                                         used KV blocks before the first cancel
  deadline HOST:PORT N MAX_TOKENS SECS
                                         N streams with a client deadline → DEADLINE_EXCEEDED
  rawdeadline HOST:PORT MAX_TOKENS MS [BG]
                                         grpc-timeout header, no client deadline (curl, h2c):
                                         the server itself must end with grpc-status 4; BG
                                         streams without a deadline keep the decode node busy
  garbage HOST:PORT                      garbage, truncated frame, HTTP/1.1, bad protobufs,
                                         broken gRPC framing (curl), impossible requests
  nodekill HOST:PORT PID SIGNAL BOUND_MS REFS MAX_TOKENS
                                         streams of the prompts in REFS (lines 'ids|ref ids'),
                                         PID (a decode node, or the router) signalled (KILL or
                                         STOP) once every stream has a token: its streams end
                                         UNAVAILABLE within BOUND_MS, the others equal their
                                         references
  forgotten HOST:PORT PID STOP_S MAX_TOKENS URL BOUND_S OUT [ROLE]
                                         a stream's decode (ROLE unified: unified) node PID
                                         stopped STOP_S (the router drops it), continued: it drops
                                         the stream within BOUND_S (URL: its metrics); the stream
                                         ends OK or says why
  stopkill HOST:PORT PID WAIT_MS REFS MAX_TOKENS
                                         the node PID is stopped (SIGSTOP), the streams start,
                                         after WAIT_MS it is SIGKILLed: every stream must equal
                                         its reference (retried on another pair) or, only if it
                                         had tokens, end UNAVAILABLE
  stall HOST:PORT PID AFTER MODE SECS MAX_TOKENS [URL]
                                         the node PID stops (SIGSTOP) before the request
                                         (AFTER < 0) or after AFTER tokens; MODE deadline (the
                                         call's deadline is SECS) or cancel (SECS after the
                                         stop): DEADLINE_EXCEEDED / CANCELLED, then SIGCONT
  controlgarbage ROUTER_CTL DECODE_CTL PREFILL_CTL VOCAB MAX_SEQ [GATEWAY]
                                         hostile calls on the control APIs: each must end with
                                         a status, and the impossible ones must fail; with
                                         GATEWAY, registrations under the live nodes' ids
                                         (ALREADY_EXISTS) while a stream runs there, which must
                                         finish OK
  stepsforeign DECODE_CTL                a Steps subscriber that is not the decode node's
                                         router (its --router is elsewhere): PERMISSION_DENIED
  httpgarbage URL                        garbage on a /metrics port: connections closed,
                                         /metrics still served
  slowreader HOST:PORT MAX_TOKENS SECS   a raw h2c client that never opens its stream window:
                                         no DATA may come, the stream must end with trailers
                                         (its status) within SECS
  churn HOST:PORT REFS MAX_TOKENS SECS THREADS STOPFILE
                                         streams back to back while nodes die and come back:
                                         each OK and exact, or UNAVAILABLE; half at least OK
  migrate HOST:PORT MAX_TOKENS REFS SAMPLING AFTER KILL NODES EXPECT
                                         streams of the prompts in REFS with SAMPLING ('greedy'
                                         or 'T,SEED,REPETITION,FREQUENCY'); once every stream
                                         has AFTER tokens, SIGKILL the decode nodes of NODES
                                         (NAME=PID=METRICS_URL,...) that run a sequence (KILL
                                         'serving'; 'stop': SIGSTOP them) or all of them
                                         ('all'); prints 'killed NAME' ('stopped NAME'). EXPECT 'moved': each stream OK, equal to its
                                         reference, usage.migrations 1 (the gap around the
                                         kill printed); 'fail': each ends UNAVAILABLE naming
                                         why, its tokens a prefix of the reference
  migratehttp OPENAI_URL MAX_TOKENS REFS SAMPLING AFTER NODES [EXTRA]
                                         'migrate ... serving moved' through the OpenAI API: a
                                         streamed completion of each prompt (ids) with
                                         include_usage, run untouched first; once it has AFTER
                                         tokens the serving decode node is SIGKILLed: the same
                                         text and usage, plus usage.migrations 1; EXTRA: a
                                         JSON object merged into each body (a grammar:
                                         '{"guided_regex": ...}')
  ping HOST:PORT                          one short request must succeed
  run HOST:PORT MAX_TOKENS REFS          every prompt of REFS concurrently; all must equal refs
  health NODE_CTL SERVICE WANT           grpc.health.v1 Check of SERVICE ("" = readiness) on a
                                         node's control port answers WANT (SERVING, NOT_SERVING)
  drain HOST:PORT HOW NODE_CTL METRIC NODE_URL OTHER_URL REFS MAX_TOKENS NEW_REFS NEW_MAX [TIMEOUT_MS]
                                         streams of the prompts in REFS (- : none); once each
                                         has a token the node is drained (HOW: TERM:PID; exec:CMD,
                                         a command that must exit 0, e.g. tandem drain; or rpc:
                                         an unsigned Node/Drain call to NODE_CTL, with
                                         TIMEOUT_MS): while
                                         streams run it must answer readiness NOT_SERVING and
                                         liveness SERVING; the prompts of NEW_REFS (- : none)
                                         then succeed, counted in METRIC at OTHER_URL, never at
                                         NODE_URL; every first stream must end OK equal to its
                                         reference (with TIMEOUT_MS: or UNAVAILABLE, a prefix)
"""
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from cluster_wire import (GENERATE, channel, fields, generate_stub, parse_ids, pb_bytes, pb_f32, pb_packed, pb_varint,
                          raw_fields, request)


def fetch_metric(url, name, label=""):
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series, _, value = line.rpartition(" ")
        base = series.split("{", 1)[0]
        if base != name:
            continue
        if label and label not in series.replace('"', ""):
            continue
        total += float(value)
        found = True
    if not found:
        raise KeyError("%s%s not in %s" % (name, "{" + label + "}" if label else "", url))
    return total


class Stream:
    """One Generate stream on its own thread; records ids, status and the time it ended."""

    def __init__(self, stub, ids, max_tokens, timeout=50, on_message=None, extra=b""):
        """extra: more GenerateRequest fields (their bytes)."""
        self.ids, self.got, self.code, self.details = ids, [], None, ""
        self.first = threading.Event()
        self.t_end = None
        self.cancelled = False
        self.on_message = on_message
        self.call = stub(request(ids, max_tokens) + extra, timeout=timeout)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for m in self.call:
                self.got += parse_ids(m)
                if self.got:
                    self.first.set()
                if self.on_message:
                    self.on_message(self)
            self.code = "OK"
        except grpc.RpcError as e:
            self.code = e.code().name
            self.details = e.details() or ""
        except Exception as e:  # a parse error is a failure too, never a hang
            self.code = "CLIENT_ERROR"
            self.details = repr(e)
        self.t_end = time.monotonic()
        self.first.set()

    def join(self, timeout):
        self.thread.join(timeout)
        return not self.thread.is_alive()


def fail(msg):
    print("FAIL: " + msg)
    return 1


def read_refs(path):
    prompts, refs = [], []
    with open(path) as f:
        for line in f:
            p, _, r = line.rstrip("\n").partition("|")
            prompts.append([int(x) for x in p.split()])
            refs.append([int(x) for x in r.split()])
    return prompts, refs


# ---- subcommands -------------------------------------------------------------------------

def cmd_metric(url, name, label=""):
    v = fetch_metric(url, name, label)
    print("%d" % v if v == int(v) else v)
    return 0


def histogram_quantile(url, name, q):
    """The upper bound of the bucket holding quantile q of a histogram (Prometheus's
    histogram_quantile without the interpolation: never under the truth), and the count."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rpartition(" ")[2])))
    if not buckets:
        raise KeyError("%s not in %s" % (name, url))
    buckets.sort()
    total = buckets[-1][1]
    for le, cum in buckets:
        if cum >= q * total:
            return le, int(total)
    return float("inf"), int(total)


def cmd_looplag(bound_s, *named_urls):
    """looplag BOUND_S NAME=URL...: each process's loop-lag p99 (tandem_event_loop_lag_seconds)
    must be under BOUND_S; prints it with the longest run of callbacks."""
    rc = 0
    for nu in named_urls:
        name, url = nu.split("=", 1)
        p99, n = histogram_quantile(url, "tandem_event_loop_lag_seconds", 0.99)
        longest = fetch_metric(url, "tandem_event_loop_longest_run_seconds")
        print("%s: loop lag p99 <= %g s over %d samples, longest run of callbacks %.1f ms" % (name, p99, n,
                                                                                           longest * 1e3))
        if n < 10:
            rc = fail("%s: only %d loop-lag samples: is the lag timer running?" % (name, n))
        elif p99 > float(bound_s):
            rc = fail("%s: loop lag p99 %g s is over the bound %s s" % (name, p99, bound_s))
    return rc


def cmd_bigprompt(target, n_bytes, out_path):
    """bigprompt TARGET BYTES OUT: one Generate with a text prompt of BYTES letters (one
    pre-token, the costliest text to encode), on a thread; writes 'CODE details' to OUT
    when the call ends."""
    text = "a" * int(n_bytes)
    req = pb_bytes(1, text) + pb_varint(3, 4)
    try:
        for _ in generate_stub(channel(target))(req, timeout=120):
            pass
        res = "OK"
    except grpc.RpcError as e:
        res = "%s %s" % (e.code().name, e.details())
    with open(out_path, "w") as f:
        f.write(res + "\n")
    return 0


def cmd_waitmetric(url, name, op, value, seconds):
    value, end, v = float(value), time.monotonic() + float(seconds), None
    ok = {"==": lambda a: a == value, "<=": lambda a: a <= value, ">=": lambda a: a >= value}[op]
    while True:
        try:
            v = fetch_metric(url, name)
            if ok(v):
                print("%g" % v)
                return 0
        except (OSError, KeyError) as e:
            v = repr(e)
        if time.monotonic() > end:
            return fail("%s stayed %s, not %s %g within %s s" % (name, v, op, value, seconds))
        time.sleep(0.05)


def cmd_cancel(target, n, max_tokens, after, metrics_url=""):
    """Each stream is cancelled as soon as it has `after` tokens (0: at its first message);
    with metrics_url, the decode node's used KV blocks are read (and printed) before the first
    cancel."""
    n, max_tokens, after = int(n), int(max_tokens), int(after)
    stub = generate_stub(channel(target))
    lock = threading.Lock()
    seen = []

    def cancel_when(s):
        if len(s.got) < after or s.cancelled:
            return
        with lock:
            if metrics_url and not seen:
                seen.append(fetch_metric(metrics_url, "tandem_decode_kv_blocks_used"))
                print("in-flight kv blocks used: %d" % seen[0], flush=True)
        s.cancelled = True
        s.call.cancel()

    streams = []
    for k in range(n):
        s = Stream(stub, [1, 10 + k], max_tokens, on_message=cancel_when)
        streams.append(s)
    rc = 0
    for s in streams:
        if not s.join(40):
            rc = fail("a cancelled stream did not end within 40 s")
            continue
        print("stream %s: %s after %d tokens" % (s.ids, s.code, len(s.got)))
        if s.code != "CANCELLED":
            rc = fail("stream %s ended %s %s, not CANCELLED (finished before the cancel?)" % (s.ids, s.code, s.details))
    return rc


def cmd_deadline(target, n, max_tokens, secs):
    n, max_tokens, secs = int(n), int(max_tokens), float(secs)
    stub = generate_stub(channel(target))
    streams = [Stream(stub, [1, 20 + k], max_tokens, timeout=secs) for k in range(n)]
    rc = 0
    for s in streams:
        if not s.join(40):
            rc = fail("a stream with a %g s deadline did not end within 40 s" % secs)
            continue
        print("stream %s: %s after %d tokens" % (s.ids, s.code, len(s.got)))
        if s.code != "DEADLINE_EXCEEDED":
            rc = fail("stream %s ended %s %s, not DEADLINE_EXCEEDED" % (s.ids, s.code, s.details))
    return rc


def cmd_rawdeadline(target, max_tokens, ms, n_background="0"):
    """curl sends grpc-timeout and waits with no deadline of its own: the status is the server's.
    n_background streams without a deadline run meanwhile (a busier decode node)."""
    stub = generate_stub(channel(target))
    bg = [Stream(stub, [1, 30 + k], int(max_tokens)) for k in range(int(n_background))]
    for s in bg:
        s.first.wait(20)
    body = request([1, 5], int(max_tokens))
    frame = b"\x00" + len(body).to_bytes(4, "big") + body
    try:
        p = subprocess.run(["curl", "-s", "--http2-prior-knowledge", "--max-time", "30", "-D", "-", "-o", "/dev/null",
                            "-H", "content-type: application/grpc", "-H", "te: trailers",
                            "-H", "grpc-timeout: %sm" % ms, "--data-binary", "@-",
                            "http://%s%s" % (target, GENERATE)], input=frame, capture_output=True, timeout=40)
    except FileNotFoundError:
        print("SKIP (rawdeadline): no curl")
        return 0
    for s in bg:
        s.join(40)
    hdrs = p.stdout.decode(errors="replace").lower()
    status = [l.split(":", 1)[1].strip() for l in hdrs.splitlines() if l.startswith("grpc-status:")]
    print("curl rc %d, grpc-status %s" % (p.returncode, status))
    if status != ["4"]:
        return fail("grpc-timeout %s ms: the server answered grpc-status %s, not 4 (DEADLINE_EXCEEDED); headers: %s"
                    % (ms, status, hdrs.replace("\r\n", " | ")))
    return 0


def expect_closed(sock, what, seconds=5.0):
    """Reads until EOF or reset; the server must close the connection within seconds."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    got = 0
    try:
        while time.monotonic() < end:
            b = sock.recv(65536)
            if not b:
                return True, "closed after %d bytes from the server" % got
            got += len(b)
    except ConnectionResetError:
        return True, "reset after %d bytes from the server" % got
    except socket.timeout:
        pass
    return False, "%s: connection still open after %g s (%d bytes from the server)" % (what, seconds, got)


def probe_connections(addr, cases, served):
    """Each case (what, bytes, half_close) on its own connection: the server must close it
    (a half-closed one only once the client half-closes, checking served() meanwhile), and
    served(what) (None, or what went wrong) must hold after each. Returns 0 or 1."""
    rc = 0
    for what, data, half_close in cases:
        s = socket.create_connection(addr, timeout=5)
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may close before it read everything
        if half_close:
            err = served(what + " (still open)")
            if err:
                rc = fail(err)
            s.shutdown(socket.SHUT_WR)
        closed, how = expect_closed(s, what)
        s.close()
        print("%s: %s" % (what, how))
        if not closed:
            rc = fail(how)
        err = served(what)
        if err:
            rc = fail(err)
    return rc


def normal_ok(stub, what):
    try:
        got = []
        for m in stub(request([1, 7], 8), timeout=20):
            got += parse_ids(m)
        if len(got) != 8:
            return "after %s: a normal request gave %d tokens, not 8" % (what, len(got))
        return None
    except grpc.RpcError as e:
        return "after %s: a normal request failed %s %s" % (what, e.code().name, e.details())


def cmd_garbage(target):
    host, port = target.rsplit(":", 1)
    addr = (host, int(port))
    stub = generate_stub(channel(target))
    rnd = random.Random(5)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    cases = [
        ("random bytes", bytes(rnd.randrange(256) for _ in range(4096)), False),
        # a HEADERS frame announcing 200 bytes that never come, then a half-close
        ("a truncated HTTP/2 frame", preface + settings + b"\x00\x00\xc8\x01\x04\x00\x00\x00\x01" + b"\x82\x86\x84", True),
        ("an HTTP/1.1 request", b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n", False),
        ("an HTTP/1.1 POST to the gRPC path",
         b"POST " + GENERATE.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/grpc\r\n"
         b"Content-Length: 5\r\n\r\n\x00\x00\x00\x00\x00", False),
    ]
    # while a half-open connection waits for the rest of its frame, others are served
    rc = probe_connections(addr, cases, lambda what: normal_ok(stub, what))
    # valid gRPC framing carrying bodies that are not a GenerateRequest
    bodies = [
        ("bad varint", b"\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"),
        ("length past the end", b"\x12\x40\x01\x02"),
        ("wrong wire type for prompt_ids", b"\x15\x01\x02\x03\x04"),
        ("group wire type", b"\x0b\x0c"),
        ("field number 0", b"\x00\x01"),
        ("random bytes", bytes(rnd.randrange(256) for _ in range(300))),
    ]
    for what, body in bodies:
        try:
            it = stub(body, timeout=20)
            n = sum(len(parse_ids(m)) for m in it)
            rc = fail("invalid protobuf (%s): the call succeeded with %d tokens" % (what, n))
        except grpc.RpcError as e:
            print("invalid protobuf (%s): %s %s" % (what, e.code().name, e.details()))
            if e.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL):
                rc = fail("invalid protobuf (%s): %s, not INVALID_ARGUMENT or INTERNAL" % (what, e.code().name))
        err = normal_ok(stub, "invalid protobuf (%s)" % what)
        if err:
            rc = fail(err)
    rc = garbage_frames(target, stub) or rc
    return invalid_requests(stub) or rc


def invalid_requests(stub):
    """Well-formed requests that can never succeed must end INVALID_ARGUMENT (not be retried
    into UNAVAILABLE, which tells a client to try again; fixed in the router by 1fa148d), each
    with its own message naming what is wrong (issue 21: the gateway took top_p -0.5 and NaN as
    "off", and gave one message to a text prompt or stop string without a tokenizer and to a
    300-byte stop string). The router of test_cluster_garbage has no tokenizer (stories260K
    has none beside it)."""
    rc = 0
    ok_ids = request([1, 7], 8)

    def sampling(*fields):
        return ok_ids + pb_bytes(4, b"".join(fields))

    cases = [
        ("an empty prompt", request([], 8), "the prompt is empty"),
        ("a prompt id outside the vocabulary (512)", request([1, 100000], 8), "100000 is outside the vocabulary"),
        ("a prompt longer than the model (600 ids)", request([1] + [k % 512 for k in range(2, 601)], 8),
         "600"),
        ("top_p -0.5", sampling(pb_f32(3, -0.5)), "top_p -0.5 is out of range (0, 1]"),
        ("top_p NaN", sampling(pb_f32(3, float("nan"))), "top_p nan is out of range (0, 1]"),
        ("repetition_penalty -2", sampling(pb_f32(5, -2.0)), "repetition_penalty -2 is out of range (0, 100]"),
        ("repetition_penalty NaN", sampling(pb_f32(5, float("nan"))), "repetition_penalty nan is out of range"),
        ("temperature inf", sampling(pb_f32(1, float("inf"))), "temperature inf is out of range [0, 100]"),
        ("min_p -inf", sampling(pb_f32(4, float("-inf"))), "min_p -inf is out of range [0, 1)"),
        ("max_tokens 2^32-1", request([1, 7], 2**32 - 1), "max_tokens 4294967295 is out of range [0, 2147483647]"),
        ("a 300-byte stop string", ok_ids + pb_bytes(6, "s" * 300),
         "stop string 0 is 300 bytes long, at most 256 allowed"),
        ("17 stop strings", ok_ids + b"".join(pb_bytes(6, "s%d" % k) for k in range(17)),
         "stop_strings has 17 strings, at most 16 allowed"),
        ("33 stop ids", ok_ids + pb_packed(5, range(33)), "stop_ids has 33 ids, at most 32 allowed"),
        ("a stop string without a tokenizer", ok_ids + pb_bytes(6, "the end"),
         "no tokenizer (--tokenizer) to match stop strings"),
        ("a text prompt without a tokenizer", pb_bytes(1, "Once upon a time") + pb_varint(3, 8),
         "no tokenizer (--tokenizer) for a text prompt"),
    ]
    seen = {}
    for what, body, says in cases:
        try:
            n = sum(len(parse_ids(m)) for m in stub(body, timeout=20))
            rc = fail("%s: the call succeeded with %d tokens" % (what, n))
            continue
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
        print("%s: %s %s" % (what, code, details))
        if code != "INVALID_ARGUMENT":
            rc = fail("%s: %s %s, want INVALID_ARGUMENT" % (what, code, details))
        if says not in details:
            rc = fail("%s: '%s' does not say '%s'" % (what, details, says))
        if details in seen:
            rc = fail("%s and %s get the same message '%s'" % (seen[details], what, details))
        seen[details] = what
        err = normal_ok(stub, what)
        if err:
            rc = fail(err)
    # 0 is proto3's unset: top_p and repetition_penalty 0 are "off", not refused
    try:
        n = sum(len(parse_ids(m)) for m in stub(sampling(pb_f32(3, 0.0), pb_f32(5, 0.0)), timeout=20))
        if n != 8:
            rc = fail("top_p 0 and repetition_penalty 0 (unset): %d tokens, not 8" % n)
    except grpc.RpcError as e:
        rc = fail("top_p 0 and repetition_penalty 0 (unset): %s %s" % (e.code().name, e.details()))
    return rc


def curl_grpc(target, frame, timeout_s=20):
    """POSTs raw gRPC frame bytes over h2c with curl; returns (rc, [grpc-status values]) or None."""
    try:
        p = subprocess.run(["curl", "-s", "--http2-prior-knowledge", "--max-time", str(timeout_s), "-D", "-",
                            "-o", "/dev/null", "-H", "content-type: application/grpc", "-H", "te: trailers",
                            "--data-binary", "@-", "http://%s%s" % (target, GENERATE)],
                           input=frame, capture_output=True, timeout=timeout_s + 10)
    except FileNotFoundError:
        return None
    hdrs = p.stdout.decode(errors="replace").lower()
    return p.returncode, [l.split(":", 1)[1].strip() for l in hdrs.splitlines() if l.startswith("grpc-status:")]


def garbage_frames(target, stub):
    """Broken gRPC framing inside a valid HTTP/2 stream (sent with curl)."""
    rc = 0
    body = request([1, 2], 4)
    frames = [
        ("a length prefix past the end of the stream", b"\x00\x00\x00\x00\x64" + body),
        ("the compressed flag without grpc-encoding", b"\x01" + len(body).to_bytes(4, "big") + body),
        ("a 4 GiB length prefix", b"\x00\xff\xff\xff\xff" + body),
        ("a 3-byte frame", b"\x00\x00\x00"),
        ("two messages on a unary-request stream", (b"\x00" + len(body).to_bytes(4, "big") + body) * 2),
    ]
    for what, frame in frames:
        r = curl_grpc(target, frame)
        if r is None:
            print("SKIP (broken gRPC frames): no curl")
            return 0
        crc, status = r
        print("%s: curl rc %d, grpc-status %s" % (what, crc, status))
        if len(status) != 1 or status[0] not in ("3", "8", "12", "13"):
            rc = fail("%s: grpc-status %s, want one of INVALID_ARGUMENT(3) RESOURCE_EXHAUSTED(8) "
                      "UNIMPLEMENTED(12) INTERNAL(13) (curl rc %d)" % (what, status, crc))
        err = normal_ok(stub, what)
        if err:
            rc = fail(err)
    return rc


def cmd_nodekill(target, pid, sig, bound_ms, refs_path, max_tokens):
    pid, bound_ms, max_tokens = int(pid), float(bound_ms), int(max_tokens)
    signum = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[sig]
    prompts, refs = read_refs(refs_path)
    stub = generate_stub(channel(target))
    streams = [Stream(stub, p, max_tokens) for p in prompts]
    end = time.monotonic() + 30
    for s in streams:
        s.first.wait(max(0.0, end - time.monotonic()))
    t_kill = time.monotonic()
    os.kill(pid, signum)
    rc, n_unavail, n_ok = 0, 0, 0
    for s, ref in zip(streams, refs):
        if not s.join(40):
            rc = fail("stream %s did not end within 40 s of the kill" % s.ids[:4])
            continue
        ms = (s.t_end - t_kill) * 1e3
        print("stream %s...: %s after %d tokens, %.0f ms after SIG%s" % (s.ids[:3], s.code, len(s.got), ms, sig))
        if s.code == "OK":
            n_ok += 1
            if s.got != ref:
                rc = fail("stream %s: ids differ from tandem generate:\n  want %s\n  got  %s" % (s.ids[:4], ref, s.got))
        elif s.code == "UNAVAILABLE":
            n_unavail += 1
            if ms > bound_ms:
                rc = fail("stream %s: UNAVAILABLE %.0f ms after the kill, past the %.0f ms bound" % (s.ids[:4], ms, bound_ms))
            if s.got != ref[:len(s.got)]:
                rc = fail("stream %s: tokens before the failure differ from tandem generate" % s.ids[:4])
            if n_unavail == 1:
                print("  %s" % s.details)
        else:
            rc = fail("stream %s: ended %s %s (want OK or UNAVAILABLE)" % (s.ids[:4], s.code, s.details))
    print("%d streams OK, %d UNAVAILABLE" % (n_ok, n_unavail))
    if n_unavail == 0:
        rc = fail("no stream ended UNAVAILABLE: the killed decode node had none running (or they all finished first)")
    return rc


def cmd_stopkill(target, pid, wait_ms, refs_path, max_tokens):
    pid, wait_ms, max_tokens = int(pid), float(wait_ms), int(max_tokens)
    prompts, refs = read_refs(refs_path)
    stub = generate_stub(channel(target))
    os.kill(pid, signal.SIGSTOP)  # requests sent to it now wait in its socket
    streams = [Stream(stub, p, max_tokens) for p in prompts]
    time.sleep(wait_ms / 1e3)
    os.kill(pid, signal.SIGKILL)
    rc, n_ok, n_unavail = 0, 0, 0
    for s, ref in zip(streams, refs):
        if not s.join(40):
            rc = fail("stream %s did not end within 40 s of the kill" % s.ids[:4])
            continue
        print("stream %s...: %s after %d tokens" % (s.ids[:3], s.code, len(s.got)))
        if s.code == "OK":
            n_ok += 1
            if s.got != ref:
                rc = fail("stream %s: ids differ from tandem generate:\n  want %s\n  got  %s" % (s.ids[:4], ref, s.got))
        elif s.code == "UNAVAILABLE" and s.got:
            n_unavail += 1
        else:
            rc = fail("stream %s: ended %s %s after %d tokens (want OK, or UNAVAILABLE after tokens)"
                      % (s.ids[:4], s.code, s.details, len(s.got)))
    print("%d streams OK, %d UNAVAILABLE after tokens" % (n_ok, n_unavail))
    return rc


def cmd_stall(target, pid, after, mode, secs, max_tokens, metrics_url=""):
    """A node (PID) stops (SIGSTOP) under a request: before it is sent (after < 0) or once it
    has `after` tokens. mode deadline: the call's deadline is secs from its start; cancel: the
    client cancels secs after the stop. The call must end DEADLINE_EXCEEDED / CANCELLED; then
    the node continues (SIGCONT). metrics_url (a decode node that is not stopped): its used KV
    blocks 0.2 s into the stall are printed ('stalled kv blocks used: N')."""
    pid, after, secs, max_tokens = int(pid), int(after), float(secs), int(max_tokens)
    stub = generate_stub(channel(target))
    stopped = threading.Event()

    def stop_at(s):
        if after >= 0 and len(s.got) >= after and not stopped.is_set():
            os.kill(pid, signal.SIGSTOP)
            stopped.set()

    if after < 0:
        os.kill(pid, signal.SIGSTOP)
        stopped.set()
    try:
        s = Stream(stub, [1, 3, 5, 7], max_tokens, timeout=secs if mode == "deadline" else 50, on_message=stop_at)
        if not stopped.wait(20):
            return fail("the stream never had %d tokens (%s %s)" % (after, s.code, s.details))
        t_stop = time.monotonic()
        if metrics_url:
            time.sleep(0.2)
            print("stalled kv blocks used: %d" % fetch_metric(metrics_url, "tandem_decode_kv_blocks_used"), flush=True)
        if mode == "cancel":
            time.sleep(max(0.0, secs - (time.monotonic() - t_stop)))
            s.call.cancel()
        if not s.join(20):
            return fail("the stalled stream did not end within 20 s")
    finally:
        os.kill(pid, signal.SIGCONT)
    want = "DEADLINE_EXCEEDED" if mode == "deadline" else "CANCELLED"
    print("stall (%s, stop %s): %s after %d tokens, %.0f ms after the stop"
          % (mode, "before the request" if after < 0 else "after %d tokens" % after, s.code, len(s.got),
             (s.t_end - t_stop) * 1e3))
    if s.code != want:
        return fail("the stalled stream ended %s %s, not %s" % (s.code, s.details, want))
    return 0


def cmd_forgotten(target, pid, stop_s, max_tokens, metrics_url, bound_s, out_path, role="decode"):
    """One stream of MAX_TOKENS (ignore_eos); once it has 8 tokens its decode node PID stops (SIGSTOP) for
    STOP_S (past the router's heartbeat timeout: the router drops the node, moving or failing
    the stream), then continues (SIGCONT). The node must drop what the router forgot: its
    running and waiting sequences 0 and no KV block used (METRICS_URL) within BOUND_S of the
    SIGCONT (ROLE unified: a unified node's series). Runs on: writes 'dropped S' (seconds after the SIGCONT) to OUT_PATH at once, and
    'stream CODE after N tokens' once the stream ended: OK (moved), or a status with a message
    (not UNKNOWN), within 60 s."""
    pid, stop_s, bound_s = int(pid), float(stop_s), float(bound_s)
    stub = generate_stub(channel(target))
    had = threading.Event()
    s = Stream(stub, [1, 3, 5, 7], int(max_tokens), timeout=60,  # ignore_eos (field 12): a random model's
               on_message=lambda st: len(st.got) >= 8 and had.set(), extra=pb_varint(12, 1))  # EOS ends no stream
    if not had.wait(30):
        return fail("the stream never had 8 tokens (%s %s)" % (s.code, s.details))
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    t_cont, rc, v = time.monotonic(), 0, {}
    names = tuple("tandem_%s_%s" % (role, n) for n in ("running_sequences", "waiting_sequences", "kv_blocks_used"))
    while True:
        try:
            v = {n: fetch_metric(metrics_url, n) for n in names}
        except (OSError, KeyError) as e:
            v = {"error": repr(e)}
        if all(v.get(n) == 0 for n in names):
            break
        if time.monotonic() - t_cont > bound_s:
            rc = fail("%.1f s after SIGCONT the node still holds what the router forgot: %s" % (bound_s, v))
            break
        time.sleep(0.05)
    with open(out_path, "w") as f:
        f.write("dropped %.2f\n" % (time.monotonic() - t_cont) if rc == 0 else "not dropped\n")
    print("%d tokens before the stop; %s" % (len(s.got), "the node dropped them %.2f s after SIGCONT" %
                                             (time.monotonic() - t_cont) if rc == 0 else "not dropped"), flush=True)
    if not s.join(60):
        return fail("the stream did not end within 60 s of the SIGCONT")
    print("stream %s %s after %d tokens" % (s.code, s.details, len(s.got)))
    with open(out_path, "a") as f:
        f.write("stream %s after %d tokens\n" % (s.code, len(s.got)))
    if s.code != "OK" and (s.code in ("UNKNOWN", "CLIENT_ERROR") or not s.details):
        rc = fail("the stream ended %s '%s': want OK (moved) or a status that says why" % (s.code, s.details))
    return rc


def control_call(target, method, body, streaming=False, timeout=10):
    """One raw control-API call; returns (code name, details, response bytes list)."""
    ch = channel(target)
    try:
        if streaming:
            stub = ch.unary_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            out = list(stub(body, timeout=timeout))
        else:
            stub = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            out = [stub(body, timeout=timeout)]
        return "OK", "", out
    except grpc.RpcError as e:
        return e.code().name, e.details() or "", []
    finally:
        ch.close()


def cmd_controlgarbage(router_ctl, decode_ctl, prefill_ctl, vocab, max_seq, gateway=""):
    """Hostile or broken calls on the control API of the router and of each node; each must
    end with a status (never a crash or a hang), and the ones that cannot be right must fail.
    With a gateway: a stream runs on the live nodes d0 and p0 while registrations under their
    ids are refused ALREADY_EXISTS, and it must finish OK."""
    vocab, max_seq = int(vocab), int(max_seq)
    bad = ("INVALID_ARGUMENT", "INTERNAL")
    junk = bytes(random.Random(9).randrange(256) for _ in range(200))
    reg, dec, pre = "/tandem.control.v1.Registry/", "/tandem.control.v1.DecodeNode/", "/tandem.control.v1.PrefillNode/"
    layout = pb_bytes(4, pb_varint(1, 1) + pb_varint(3, 16) + pb_varint(4, 5) + pb_varint(5, 4) + pb_varint(6, 8)
                      + pb_varint(7, 1))
    capacity = pb_bytes(9, pb_varint(1, 64) + pb_varint(2, 8))
    admit_ok = pb_bytes(1, "cg-lease") + pb_varint(2, 3) + pb_varint(3, 8) + pb_varint(4, 300) + pb_packed(9, [1, 2, 3])
    cases = [
        # (what, target, method, body, streaming, allowed codes (None: any status))
        ("RegisterNode: junk", router_ctl, reg + "RegisterNode", junk, False, bad),
        ("RegisterNode: empty", router_ctl, reg + "RegisterNode", b"", False, bad),
        ("RegisterNode: a decode node nobody serves (127.0.0.1:1), a foreign model fingerprint", router_ctl, reg + "RegisterNode",
         pb_bytes(1, "ghost") + pb_varint(2, 2) + pb_bytes(3, "default") + layout + pb_bytes(5, "127.0.0.1:1")
         + pb_bytes(6, b"\x00" * 16) + capacity, False, None),
        ("Heartbeat: an unknown node", router_ctl, reg + "Heartbeat", pb_bytes(1, "nobody") + pb_varint(2, 77),
         False, ("OK",)),
        ("Heartbeat: junk", router_ctl, reg + "Heartbeat", junk, False, bad),
        ("Admit: junk", decode_ctl, dec + "Admit", junk, False, bad),
        ("Admit: a prompt id outside the vocabulary", decode_ctl, dec + "Admit",
         pb_bytes(1, "cg1") + pb_varint(2, 2) + pb_varint(3, 8) + pb_varint(4, 300) + pb_packed(9, [1, vocab + 5]),
         False, ("INVALID_ARGUMENT",)),
        ("Admit: max_tokens 2^32-1", decode_ctl, dec + "Admit",
         pb_bytes(1, "cg2") + pb_varint(2, 1) + pb_varint(3, 2**32 - 1) + pb_varint(4, 300) + pb_packed(9, [1]),
         False, None),  # the decode node reserves the prompt's blocks; the model's length ends it
        ("Admit: prompt_tokens 300 with 1 prompt id", decode_ctl, dec + "Admit",
         pb_bytes(1, "cg3") + pb_varint(2, 300) + pb_varint(3, 8) + pb_varint(4, 300) + pb_packed(9, [1]),
         False, None),
        ("Admit: a valid lease whose KV never comes (300 ms)", decode_ctl, dec + "Admit", admit_ok, False, ("OK",)),
        ("Release: an unknown lease", decode_ctl, dec + "Release", pb_varint(1, 987654321) + pb_bytes(2, "nope"),
         False, ("OK", "NOT_FOUND")),
        ("Release: junk", decode_ctl, dec + "Release", junk, False, bad),
        ("Prefill: junk", prefill_ctl, pre + "Prefill", junk, True, bad),
        ("Prefill: no tokens", prefill_ctl, pre + "Prefill", pb_bytes(1, "cg4") + pb_packed(4, [0]), True,
         ("INVALID_ARGUMENT",)),
        ("Prefill: a token outside the vocabulary", prefill_ctl, pre + "Prefill",
         pb_bytes(1, "cg5") + pb_packed(2, [1, vocab + 100]) + pb_packed(4, [0]) + pb_bytes(8, b"\x00" * 32), True,
         ("INVALID_ARGUMENT",)),
        ("Prefill: more tokens than the model's length", prefill_ctl, pre + "Prefill",
         pb_bytes(1, "cg6") + pb_packed(2, [1] * (max_seq + 8)) + pb_packed(4, list(range(40)))
         + pb_bytes(8, b"\x00" * 32), True, ("INVALID_ARGUMENT", "OUT_OF_RANGE")),
        ("Prefill: block 999999 and a junk decode_xfer", prefill_ctl, pre + "Prefill",
         pb_bytes(1, "cg7") + pb_packed(2, [1, 2, 3]) + pb_bytes(3, "d0") + pb_packed(4, [999999]) + pb_varint(5, 1)
         + pb_bytes(8, junk) + pb_bytes(10, b"\x07" * 16), True,
         ("INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL", "FAILED_PRECONDITION", "NOT_FOUND")),
        ("Prefill: no kv transfer token (issue 35)", prefill_ctl, pre + "Prefill",
         pb_bytes(1, "cg9") + pb_packed(2, [1, 2, 3]) + pb_bytes(3, "d0") + pb_packed(4, [0]) + pb_varint(5, 1)
         + pb_bytes(8, junk), True, ("FAILED_PRECONDITION",)),
        ("Prefill: a 15-byte kv transfer token", prefill_ctl, pre + "Prefill",
         pb_bytes(1, "cg10") + pb_packed(2, [1, 2, 3]) + pb_bytes(3, "d0") + pb_packed(4, [0]) + pb_varint(5, 1)
         + pb_bytes(8, junk) + pb_bytes(10, b"\x07" * 15), True, ("FAILED_PRECONDITION",)),
        ("Prefill: 40 tokens in 1 block, empty decode_xfer", prefill_ctl, pre + "Prefill",
         pb_bytes(1, "cg8") + pb_packed(2, list(range(1, 41))) + pb_bytes(3, "d0") + pb_packed(4, [0]) + pb_varint(5, 1),
         True, ("INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL", "FAILED_PRECONDITION", "NOT_FOUND")),
    ]

    def registration(node_id, role, lay=layout, cap=capacity, model="default", addr="127.0.0.1:1"):
        return (pb_bytes(1, node_id) + pb_varint(2, role) + pb_bytes(3, model) + lay + pb_bytes(5, addr)
                + pb_bytes(6, b"\x00" * 16) + cap)

    # each registration field is checked, and the refusal names it (allowed codes, then the text)
    named = [
        ("RegisterNode: role 99", registration("cg-r99", 99), "role 99"),
        ("RegisterNode: block_size 0", registration("cg-bs0", 1, lay=pb_bytes(4, pb_varint(1, 1) + pb_varint(3, 0)
                                                                           + pb_varint(4, 5) + pb_varint(5, 4)
                                                                           + pb_varint(6, 8) + pb_varint(7, 1))),
         "block_size 0"),
        ("RegisterNode: layout version 99", registration("cg-v99", 1, lay=pb_bytes(4, pb_varint(3, 16) + pb_varint(4, 5)
                                                                               + pb_varint(5, 4) + pb_varint(6, 8)
                                                                               + pb_varint(7, 99))), "version 99"),
        ("RegisterNode: no layout", registration("cg-nolay", 1, lay=b""), "layout is missing"),
        ("RegisterNode: empty model", registration("cg-nomodel", 1, model=""), "model is empty"),
        ("RegisterNode: a model name with a newline", registration("cg-nl", 1, model="def\nault"), "model has byte 0x0a"),
        ("RegisterNode: 0 KV blocks", registration("cg-cap0", 1, cap=pb_bytes(9, pb_varint(2, 8))),
         "total_kv_blocks 0"),
        ("RegisterNode: 2^32-1 KV blocks", registration("cg-capmax", 1, cap=pb_bytes(9, pb_varint(1, 2**32 - 1)
                                                                                   + pb_varint(2, 8))),
         "total_kv_blocks 4294967295"),
        ("RegisterNode: max_batch 0", registration("cg-mb0", 1, cap=pb_bytes(9, pb_varint(1, 64))), "max_batch 0"),
        ("RegisterNode: vocab_size 2^31", registration("cg-voc", 1, cap=pb_bytes(9, pb_varint(1, 64) + pb_varint(2, 8)
                                                                             + pb_varint(5, 2**31))),
         "vocab_size 2147483648"),
        ("RegisterNode: control_address without a port", registration("cg-addr", 1, addr="127.0.0.1"),
         "control_address \"127.0.0.1\""),
        ("RegisterNode: a 300-byte node id", registration("n" * 300, 1), "node_id is 300 bytes"),
        ("RegisterNode: a 1 MB transfer descriptor", registration("cg-desc", 2) + pb_bytes(6, b"\x01" * 1000000),
         "ucx_worker_address is 1000000 bytes"),
    ]
    for what, body, says in named:
        cases.append((what, router_ctl, reg + "RegisterNode", body, False, ("INVALID_ARGUMENT",), says))
    # the decode node's Steps stream has one subscriber, the router: a second one is refused,
    # and the router's stream (below: the requests that follow) goes on
    cases.append(("Steps: a second subscriber", decode_ctl, dec + "Steps", pb_bytes(1, "intruder"), True,
                  ("FAILED_PRECONDITION", "PERMISSION_DENIED"), "Steps"))
    rc = 0
    for case in cases:
        what, tgt, method, body, streaming, allowed = case[:6]
        says = case[6] if len(case) > 6 else None
        t0 = time.monotonic()
        code, details, _ = control_call(tgt, method, body, streaming, timeout=10 if not says else 5)
        print("%s: %s %s (%.0f ms)" % (what, code, details, (time.monotonic() - t0) * 1e3))
        if code == "DEADLINE_EXCEEDED":
            rc = fail("%s: no answer in time" % what)
        elif allowed is not None and code not in allowed:
            rc = fail("%s: %s, want %s" % (what, code, " or ".join(allowed)))
        elif says and says not in details:
            rc = fail("%s: the message does not say %r: %s" % (what, says, details))
    if gateway:
        rc = controlgarbage_live_ids(router_ctl, gateway, registration) or rc
    return rc


def cmd_stepsforeign(decode_ctl):
    """A Steps subscriber that is not the router the decode node registers with (its --router
    is on another host): refused PERMISSION_DENIED, never served."""
    code, details, out = control_call(decode_ctl, "/tandem.control.v1.DecodeNode/Steps", pb_bytes(1, "intruder"),
                                      True, timeout=5)
    print("Steps: a subscriber that is not the node's router: %s %s" % (code, details))
    if code != "PERMISSION_DENIED" or "subscriber" not in details:
        return fail("a foreign Steps subscriber: %s %s, want PERMISSION_DENIED naming it" % (code, details))
    return 0


def controlgarbage_live_ids(router_ctl, gateway, registration):
    """Registrations under the ids of the live nodes d0 and p0 (another address, even another
    role) while a stream runs on them: each refused ALREADY_EXISTS naming the id, and the
    stream finishes OK."""
    stub = generate_stub(channel(gateway))
    s = Stream(stub, [1, 50], 400, timeout=60)
    if not s.first.wait(30) or s.code not in (None, "OK"):
        return fail("the stream on the live nodes did not start: %s %s" % (s.code, s.details))
    rc = 0
    for node_id, role in (("d0", 2), ("p0", 1), ("d0", 1)):
        code, details, _ = control_call(router_ctl, "/tandem.control.v1.Registry/RegisterNode",
                                        registration(node_id, role, addr="127.0.0.1:2"), timeout=5)
        print("RegisterNode: the live node %s's id (role %d) while it streams (%d tokens so far): %s %s"
              % (node_id, role, len(s.got), code, details))
        if code != "ALREADY_EXISTS" or ("node id %s" % node_id) not in details:
            rc = fail("a registration under live id %s: %s %s, want ALREADY_EXISTS naming it" % (node_id, code, details))
    if not s.join(60):
        return fail("the stream on the live nodes did not end within 60 s")
    print("the stream on the live nodes: %s %s, %d tokens" % (s.code, s.details, len(s.got)))
    if s.code != "OK" or not s.got:
        rc = fail("the stream on the live nodes ended %s %s after the registrations under their ids"
                  % (s.code, s.details))
    return rc


def cmd_httpgarbage(url):
    """Garbage on an HTTP /metrics port: each connection closed (or answered with an HTTP
    error), and /metrics still served after each."""
    hostport = url.split("//", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    addr = (host, int(port))
    rnd = random.Random(11)

    def metrics_ok(what):
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200 and b"tandem_" in r.read():
                    return None
                return "after %s: /metrics answered %d" % (what, r.status)
        except OSError as e:
            return "after %s: /metrics failed: %r" % (what, e)

    cases = [
        # td_http waits for the end of the head before judging it (bounded by its size limit
        # and idle timeout), so the random bytes end with one
        ("random bytes", bytes(rnd.randrange(256) for _ in range(4096)) + b"\r\n\r\n", False),
        ("a request cut short", b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: te", True),
        ("a 100 KB header", b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n", False),
        ("the HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", False),
        ("NUL bytes in the request line", b"GET /met\x00rics HTTP/1.1\r\n\r\n", False),
    ]
    return probe_connections(addr, cases, metrics_ok)


def h2_frame(ftype, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


def hpack_literal(name, value):
    """A header field 'literal without indexing, new name', no Huffman (lengths < 127)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def cmd_slowreader(target, max_tokens, secs):
    """A raw h2c client that asks for a generation and never opens its stream's flow-control
    window (SETTINGS_INITIAL_WINDOW_SIZE 0, no WINDOW_UPDATE), while answering SETTINGS and
    PING. The server must send no DATA on the stream and end it with trailers (the status;
    HEADERS are not flow-controlled) within secs."""
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    body = request([1, 2], int(max_tokens))
    hdrs = b"".join(hpack_literal(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", GENERATE), (":authority", target),
        ("content-type", "application/grpc"), ("te", "trailers")])
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                 + h2_frame(4, 0, 0, b"\x00\x02\x00\x00\x00\x00" + b"\x00\x04\x00\x00\x00\x00")
                 + h2_frame(1, 0x4, 1, hdrs)
                 + h2_frame(0, 0x1, 1, b"\x00" + len(body).to_bytes(4, "big") + body))
    t0 = time.monotonic()
    buf, data_bytes, ended = b"", 0, None
    sock.settimeout(0.2)
    while time.monotonic() - t0 < float(secs) and not ended:
        try:
            b = sock.recv(65536)
            if not b:
                ended = "connection closed"
                break
            buf += b
        except socket.timeout:
            continue
        except ConnectionResetError:
            ended = "connection reset"
            break
        while len(buf) >= 9:
            ln = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + ln:
                break
            ftype, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload, buf = buf[9:9 + ln], buf[9 + ln:]
            if os.environ.get("CL_H2_DEBUG"):
                print("frame type %d flags %#x stream %d len %d" % (ftype, flags, stream, ln))
            if ftype == 4 and not flags & 1:
                sock.sendall(h2_frame(4, 1, 0))
            elif ftype == 6 and not flags & 1:
                sock.sendall(h2_frame(6, 1, 0, payload))
            elif ftype == 0 and stream == 1:
                data_bytes += ln
            elif ftype == 1 and stream == 1 and flags & 1:
                ended = "trailers"
            elif ftype == 3 and stream == 1:
                ended = "RST_STREAM %d" % int.from_bytes(payload[:4], "big")
            elif ftype == 7:
                ended = "GOAWAY"
    sock.close()
    print("slow reader: %s after %.0f ms, %d DATA bytes on its stream"
          % (ended or "not ended", (time.monotonic() - t0) * 1e3, data_bytes))
    if data_bytes:
        return fail("the server sent %d DATA bytes into a closed flow-control window" % data_bytes)
    if ended != "trailers":
        return fail("the stream of a client that does not read ended %s within %s s, not with trailers carrying "
                    "its status" % (ended or "not at all", secs))
    return 0


def stream_clients(target, refs_path, max_tokens, seconds, concurrency, stop_file, seed, judge):
    """churn's and pausechurn's clients: concurrency threads stream the prompts of REFS (random
    order, seeded) one after another for `seconds` (or until stop_file exists); each ended
    stream goes to judge(i, stream, ref, counts, problems) under one lock. Returns counts, problems."""
    prompts, refs = read_refs(refs_path)
    stub = generate_stub(channel(target))
    end = time.monotonic() + float(seconds)
    lock = threading.Lock()
    counts = {}
    problems = []

    def worker(k):
        rnd = random.Random(seed + k)
        while time.monotonic() < end and not os.path.exists(stop_file):
            i = rnd.randrange(len(prompts))
            s = Stream(stub, prompts[i], int(max_tokens), timeout=30)
            s.join(40)
            s.code = s.code or "HUNG"
            with lock:
                counts[s.code] = counts.get(s.code, 0) + 1
                judge(i, s, refs[i], counts, problems)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(int(concurrency))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return counts, problems


def cmd_churn(target, refs_path, max_tokens, seconds, concurrency, stop_file):
    """concurrency client threads send the prompts of REFS (random order, fixed seed) one
    stream after another for `seconds` (or until stop_file exists) while the test kills and
    restarts nodes. Every stream must end OK with exactly its reference, or UNAVAILABLE (with
    its tokens so far a prefix of the reference); at least half must succeed."""
    early = []

    def judge(i, s, ref, counts, problems):
        if s.code == "UNAVAILABLE" and not s.got:
            counts["UNAVAILABLE before any token"] = counts.get("UNAVAILABLE before any token", 0) + 1
            early.append(s.details)
        if s.code == "OK" and s.got != ref:
            problems.append("prompt %d: OK but ids differ from tandem generate:\n  want %s\n  got  %s"
                            % (i, ref, s.got))
        elif s.code == "UNAVAILABLE" and s.got != ref[:len(s.got)]:
            problems.append("prompt %d: UNAVAILABLE after tokens that differ from tandem generate" % i)
        elif s.code not in ("OK", "UNAVAILABLE"):
            problems.append("prompt %d: %s %s" % (i, s.code, s.details))

    counts, problems = stream_clients(target, refs_path, max_tokens, seconds, concurrency, stop_file, 1000, judge)
    total = sum(v for k, v in counts.items() if k != "UNAVAILABLE before any token")
    print("churn: %d streams: %s" % (total, ", ".join("%s %d" % kv for kv in sorted(counts.items()))))
    for d in sorted(set(early)):
        print("churn: UNAVAILABLE before any token: %s (x%d)" % (d, early.count(d)))
    rc = 0
    same_node = [d for d in early if "prefill node unreachable" in d]
    if same_node:
        # one of each role always stays up: a retry that still finds no prefill node went back
        # to a dead one (the router skips a node whose channel failed until it re-registers)
        rc = fail("%d of %d streams ended UNAVAILABLE before any token although another prefill node was up "
                  "('%s'): the retry went to the same dead prefill node" % (len(same_node), total, same_node[0]))
    for p in problems[:10]:
        rc = fail(p)
    if total == 0 or counts.get("OK", 0) * 2 < total:
        rc = fail("fewer than half the streams succeeded")
    return rc


def cmd_pausechurn(target, refs_path, max_tokens, seconds, concurrency, stop_file):
    """churn's clients while the test pauses nodes (SIGSTOP/SIGCONT) instead of killing them:
    concurrency threads stream the prompts of REFS back to back for `seconds` (or until
    stop_file exists). A stream must end OK with exactly its reference, or with a status a
    stall can cause (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) after tokens that are a
    prefix of it; none may hang; at least one must succeed."""
    stalled = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")

    def judge(i, s, ref, counts, problems):
        if s.code == "OK" and s.got != ref:
            problems.append("prompt %d: OK but ids differ from tandem generate:\n  want %s\n  got  %s"
                            % (i, ref, s.got))
        elif s.code in stalled and s.got != ref[:len(s.got)]:
            problems.append("prompt %d: %s after tokens that differ from tandem generate" % (i, s.code))
        elif s.code != "OK" and s.code not in stalled:
            problems.append("prompt %d: %s %s" % (i, s.code, s.details))

    counts, problems = stream_clients(target, refs_path, max_tokens, seconds, concurrency, stop_file, 2000, judge)
    total = sum(counts.values())
    print("pausechurn: %d streams: %s" % (total, ", ".join("%s %d" % kv for kv in sorted(counts.items()))))
    rc = 0
    for p in problems[:10]:
        rc = fail(p)
    if counts.get("OK", 0) == 0:
        rc = fail("no stream succeeded")
    return rc


def sampling_bytes(spec):
    """SamplingParams (GenerateRequest field 4) from 'T,SEED,REPETITION,FREQUENCY'; b'' for greedy."""
    if spec == "greedy":
        return b""
    t, seed, rep, freq = spec.split(",")
    body = pb_f32(1, float(t)) + pb_f32(5, float(rep)) + pb_varint(6, int(seed)) + pb_f32(8, float(freq))
    return pb_bytes(4, body)


def token_logprobs(msg):
    """GenerateResponse.logprobs (field 7): per token its TokenLogprob's bytes (token id,
    logprob and alternatives, compared as they are: equal bytes, equal floats)."""
    return [v for f, wt, v in raw_fields(msg) if f == 7 and wt == 2]


def usage_migrations(msg):
    """usage.migrations (GenerateResponse field 4, Usage field 4) of one message, None without usage."""
    for f, v in fields(msg):
        if f == 4 and isinstance(v, bytes):
            return next((x for g, x in fields(v) if g == 4 and isinstance(x, int)), 0)
    return None


def cmd_migrate(target, max_tokens, refs_path, sampling, after, kill, nodes, expect):
    max_tokens, after = int(max_tokens), int(after)
    prompts, refs = read_refs(refs_path)
    stub = generate_stub(channel(target))
    named = [n.split("=", 2) for n in nodes.split(",")]
    results = []

    # with log-probabilities (2 alternatives): a moved stream's must be the same floats
    body = lambda ids: request(ids, max_tokens) + sampling_bytes(sampling) + pb_bytes(11, pb_varint(1, 2))

    def run(ids, results=results):
        r = {"got": [], "lps": [], "times": [], "code": None, "details": "", "migrations": None,
             "enough": threading.Event()}
        results.append(r)
        try:
            for m in stub(body(ids), timeout=60):
                r["got"] += parse_ids(m)
                r["lps"] += token_logprobs(m)
                r["times"].append((time.monotonic(), len(r["got"])))
                mig = usage_migrations(m)
                if mig is not None:
                    r["migrations"] = mig
                if len(r["got"]) >= after:
                    r["enough"].set()
            r["code"] = "OK"
        except grpc.RpcError as e:
            r["code"], r["details"] = e.code().name, e.details() or ""
        except Exception as e:  # a parse error is a failure too, never a hang
            r["code"], r["details"] = "CLIENT_ERROR", repr(e)
        r["enough"].set()

    uninterrupted = []
    if expect == "moved":  # the same requests first, untouched: the logprobs to compare with
        for p in prompts:
            run(p, uninterrupted)
    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    while len(results) < len(threads):
        time.sleep(0.001)
    for r in results:
        r["enough"].wait(30)
    victims = [(name, int(pid)) for name, pid, url in named
               if kill == "all" or fetch_metric(url, "tandem_decode_running_sequences") >= 1]
    t_kill = time.monotonic()
    for name, pid in victims:  # 'stop': frozen, only the router's heartbeat bound can tell
        os.kill(pid, signal.SIGSTOP if kill == "stop" else signal.SIGKILL)
        print("%s %s" % ("stopped" if kill == "stop" else "killed", name))
    rc = 0 if victims else fail("no decode node of %s ran a sequence" % nodes)
    for t in threads:
        t.join(60)
    for i, (r, ref) in enumerate(zip(results, refs)):
        before = [n for tm, n in r["times"] if tm <= t_kill]
        k = before[-1] if before else 0
        # the move's gap: the longest wait between two messages from the kill on (tokens
        # already in flight arrive first); beside the median wait of the whole stream
        tms = [tm for tm, n in r["times"]]
        waits = [b - a for a, b in zip(tms, tms[1:]) if b > t_kill]
        gap = max(waits) * 1e3 if waits else -1
        allw = sorted(b - a for a, b in zip(tms, tms[1:])) or [0]
        print("stream of %d tokens: %s after %d tokens, %d at the kill, longest wait after it %.1f ms (median "
              "wait %.2f ms), migrations %s %s" % (len(ref), r["code"], len(r["got"]), k, gap,
                                                   allw[len(allw) // 2] * 1e3, r["migrations"], r["details"]))
        if expect == "moved":
            if r["code"] != "OK":
                rc = fail("stream ended %s %s (want OK: moved to another pair)" % (r["code"], r["details"]))
            elif r["got"] != ref:
                rc = fail("ids differ from tandem generate:\n  want %s\n  got  %s" % (ref, r["got"]))
            elif r["migrations"] != 1:
                rc = fail("usage.migrations is %s, want 1" % r["migrations"])
            elif uninterrupted[i]["got"] != ref or len(r["lps"]) != len(ref):
                rc = fail("the uninterrupted run (%s) or the logprobs (%d for %d tokens) are off"
                          % (uninterrupted[i]["code"], len(r["lps"]), len(ref)))
            else:
                diff = [j for j, (a, b) in enumerate(zip(r["lps"], uninterrupted[i]["lps"])) if a != b]
                if diff:
                    rc = fail("logprobs differ from an uninterrupted run's at tokens %s (moved at %d)" % (diff[:8], k))
            if not 0 < k < len(ref):
                rc = fail("the kill came at token %d of %d: not mid-stream" % (k, len(ref)))
        else:
            if r["code"] != "UNAVAILABLE" or not any(w in r["details"] for w in ("cannot move", "max-migrations")):
                rc = fail("stream ended %s '%s' (want UNAVAILABLE saying why it cannot move)" % (r["code"], r["details"]))
            if r["got"] != ref[:len(r["got"])]:
                rc = fail("tokens before the failure differ from tandem generate")
    return rc


def sse_completion(url, ids, max_tokens, sampling, on_chunk=None, extra=None):
    """A streamed /completions of prompt ids (stream_options.include_usage, logprobs 1): (text
    and token logprobs, usage, chunk times); on_chunk(n_chunks) after each chunk."""
    body = {"prompt": ids, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "logprobs": 1}
    if sampling != "greedy":
        t, seed, rep, freq = sampling.split(",")
        body.update(temperature=float(t), seed=int(seed), repetition_penalty=float(rep), frequency_penalty=float(freq))
    body.update(extra or {})
    req = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, lps, usage, times = "", [], None, []
    try:
        r = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        raise RuntimeError("HTTP %d: %s" % (e.code, e.read().decode(errors="replace")))
    with r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c.get("usage"):
                usage = c["usage"]
            if c.get("choices"):
                text += c["choices"][0].get("text") or ""
                lps += (c["choices"][0].get("logprobs") or {}).get("token_logprobs") or []
                times.append(time.monotonic())
                if on_chunk:
                    on_chunk(len(times))
    return (text, lps), usage, times


def cmd_migratehttp(url, max_tokens, refs_path, sampling, after, nodes, extra="{}"):
    max_tokens, after, extra = int(max_tokens), int(after), json.loads(extra)
    prompts, refs = read_refs(refs_path)
    named = [n.split("=", 2) for n in nodes.split(",")]
    rc = 0
    for ids, ref in zip(prompts, refs):
        want_text, want_usage, _ = sse_completion(url, ids, max_tokens, sampling, extra=extra)
        if want_usage is None or want_usage["completion_tokens"] != len(ref) or "migrations" in want_usage:
            rc = fail("the untouched run's usage is %s for %d reference tokens" % (want_usage, len(ref)))
        killed = []

        def kill_at(n):  # chunks carry about one token each
            if n == after and not killed:
                for name, pid, murl in named:
                    if fetch_metric(murl, "tandem_decode_running_sequences") >= 1:
                        os.kill(int(pid), signal.SIGKILL)
                        killed.append(name)
                        print("killed %s" % name)

        text, usage, times = sse_completion(url, ids, max_tokens, sampling, kill_at, extra)
        if not killed:
            rc = fail("no decode node of %s ran the stream" % nodes)
        print("openai stream: %d chunks, %d token logprobs, usage %s" % (len(times), len(text[1]), usage))
        if len(text[1]) != len(ref):
            rc = fail("%d token logprobs for %d tokens" % (len(text[1]), len(ref)))
        if text != want_text:
            rc = fail("text differs from the untouched run's:\n  want %r\n  got  %r" % (want_text, text))
        if not usage or usage.get("migrations") != 1 or usage["completion_tokens"] != want_usage["completion_tokens"]:
            rc = fail("usage %s, want %s with migrations 1" % (usage, want_usage))
    return rc


def cmd_ping(target):
    """One short request (8 tokens) must succeed."""
    err = normal_ok(generate_stub(channel(target)), "nothing")
    return fail(err) if err else 0


def cmd_run(target, max_tokens, refs_path):
    prompts, refs = read_refs(refs_path)
    stub = generate_stub(channel(target))
    streams = [Stream(stub, p, int(max_tokens)) for p in prompts]
    rc = 0
    for s, ref in zip(streams, refs):
        if not s.join(50):
            rc = fail("stream %s did not end within 50 s" % s.ids[:4])
        elif s.code != "OK":
            rc = fail("stream %s: %s %s" % (s.ids[:4], s.code, s.details))
        elif s.got != ref:
            rc = fail("stream %s: ids differ from tandem generate:\n  want %s\n  got  %s" % (s.ids[:4], ref, s.got))
    print("%d requests, %s" % (len(streams), "all equal tandem generate" if rc == 0 else "some failed"))
    return rc


HEALTH = "/grpc.health.v1.Health/Check"
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def health(node_ctl, service=""):
    """The status name a node's grpc.health.v1 Check answers, or the gRPC code's name."""
    code, details, out = control_call(node_ctl, HEALTH, pb_bytes(1, service) if service else b"", timeout=5)
    if code != "OK":
        return code
    return HEALTH_STATUS.get(dict(fields(out[0])).get(1, 0), "?")


def cmd_health(node_ctl, service, want):
    got = health(node_ctl, service)
    print("health %s service '%s': %s" % (node_ctl, service, got))
    return 0 if got == want else fail("health of service '%s' is %s, want %s" % (service, got, want))


def cmd_drain(target, how, node_ctl, metric, node_url, other_url, refs_path, max_tokens, new_refs_path, new_max,
              timeout_ms="0"):
    max_tokens, new_max, timeout_ms = int(max_tokens), int(new_max), int(timeout_ms)
    prompts, refs = read_refs(refs_path) if refs_path != "-" else ([], [])
    rc = 0
    if health(node_ctl) != "SERVING":
        rc = fail("the node was not SERVING before the drain: %s" % health(node_ctl))
    stub = generate_stub(channel(target))
    streams = [Stream(stub, p, max_tokens, timeout=120) for p in prompts]
    end = time.monotonic() + 30
    for s in streams:
        s.first.wait(max(0.0, end - time.monotonic()))
    t0 = time.monotonic()
    before = sum(1 for s in streams if s.t_end is None)
    if how.startswith("TERM:"):
        os.kill(int(how[5:]), signal.SIGTERM)
    elif how.startswith("exec:"):
        r = subprocess.run(shlex.split(how[5:]), capture_output=True, text=True, timeout=30)
        print((r.stdout + r.stderr).strip())
        if r.returncode != 0:
            rc = fail("%s exited %d" % (how[5:], r.returncode))
    else:
        code, details, out = control_call(node_ctl, "/tandem.control.v1.Node/Drain", pb_varint(1, timeout_ms))
        if code != "OK":
            rc = fail("Drain: %s %s" % (code, details))
        else:
            f = dict(fields(out[0]))
            print("Drain answered: %d requests running, timeout %d ms" % (f.get(1, 0), f.get(2, 0)))
    running = sum(1 for s in streams if s.t_end is None)
    if running:  # still draining (a short drain timeout may have ended it already)
        h = health(node_ctl)
        live = health(node_ctl, "liveness")
        print("drain sent with %d of %d streams running (%d once it was answered); readiness %s, liveness %s"
              % (before, len(streams), running, h, live))
        if h != "NOT_SERVING":
            rc = fail("a draining node answers readiness %s, want NOT_SERVING" % h)
        if live != "SERVING":
            rc = fail("a draining node answers liveness %s, want SERVING" % live)
    elif streams and not before:
        rc = fail("every stream had ended before the drain: nothing was drained (make them longer)")
    time.sleep(0.3)  # the router hears the drain in the node's next heartbeat, sent at once

    def count(url):
        try:
            return fetch_metric(url, metric)
        except (OSError, KeyError):
            return None  # the node is gone

    b_node, b_other = count(node_url), count(other_url)
    new_prompts, new_refs = read_refs(new_refs_path) if new_refs_path != "-" else ([], [])
    new = [Stream(stub, p, new_max) for p in new_prompts]
    for s, ref in zip(new, new_refs):
        if not s.join(50) or s.code != "OK" or s.got != ref:
            rc = fail("new stream %s during the drain: %s %s %s" % (s.ids[:4], s.code, s.details, s.got[:8]))
    a_node, a_other = count(node_url), count(other_url)
    print("%d new requests during the drain: %s; %s on the draining node %s -> %s, on the other %s -> %s"
          % (len(new), "all OK" if rc == 0 else "some failed", metric, b_node, a_node, b_other, a_other))
    if new and a_node is not None and b_node is not None and a_node != b_node:
        rc = fail("the draining node was given new requests")
    if new and (a_other is None or b_other is None or a_other - b_other != len(new)):
        rc = fail("the other node did not take all %d new requests" % len(new))
    n_ok = n_unavail = 0
    for s, ref in zip(streams, refs):
        if not s.join(60):
            rc = fail("stream %s did not end within 60 s" % s.ids[:4])
        elif s.code == "OK" and s.got == ref:
            n_ok += 1
        elif timeout_ms and s.code == "UNAVAILABLE" and s.got == ref[:len(s.got)]:
            n_unavail += 1
        else:
            rc = fail("stream %s: %s %s after %d of %d tokens" % (s.ids[:4], s.code, s.details, len(s.got), len(ref)))
    last = max([s.t_end for s in streams if s.t_end] or [t0]) - t0
    print("%d streams complete and exact, %d UNAVAILABLE (drain timeout); the last ended %.2f s after the drain"
          % (n_ok, n_unavail, last))
    if timeout_ms and n_unavail == 0:
        rc = fail("no stream outlived the %d ms drain timeout" % timeout_ms)
    return rc


def main():
    cmds = {"metric": cmd_metric, "waitmetric": cmd_waitmetric, "cancel": cmd_cancel, "deadline": cmd_deadline,
            "rawdeadline": cmd_rawdeadline, "garbage": cmd_garbage, "nodekill": cmd_nodekill,
            "stopkill": cmd_stopkill, "stall": cmd_stall, "forgotten": cmd_forgotten, "controlgarbage": cmd_controlgarbage, "stepsforeign": cmd_stepsforeign,
            "httpgarbage": cmd_httpgarbage, "slowreader": cmd_slowreader, "churn": cmd_churn, "pausechurn": cmd_pausechurn, "ping": cmd_ping, "run": cmd_run,
            "looplag": cmd_looplag, "bigprompt": cmd_bigprompt, "health": cmd_health,
            "drain": cmd_drain, "migrate": cmd_migrate, "migratehttp": cmd_migratehttp}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        print(__doc__)
        return 2
    return cmds[sys.argv[1]](*sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
