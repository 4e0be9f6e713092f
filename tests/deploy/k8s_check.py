"""k8s_check: checks the rendered Kubernetes manifests of deploy/k8s (test_deploy_k8s.sh).

  k8s_check.py TANDEM_BIN K8S_VERSION DIR...

For each kustomization DIR (base, overlays): renders it (deploy/k8s/render.py); validates
every object against the Kubernetes schema of K8S_VERSION (kubernetes-validate, strict:
unknown fields fail), the PodMonitor (a CRD, not in that schema) against the fields the
Prometheus Operator requires; runs `TANDEM_BIN ARGS... --check-config` for every tandem container
with its args ($(VAR) filled in) and the ConfigMap's config file in place of --config, so
that a flag or config key the binary does not know fails here; and checks that probes,
ports, the Prometheus annotation and the drain grace period agree with the config.
Prints one line per object; exit 1 with 'FAIL: ...' lines on any failure.
"""
import os
import re
import subprocess
import sys
import tempfile

import kubernetes_validate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "k8s"))
import render  # noqa: E402

ROLES = ("router", "prefill", "decode", "unified")
FAILS = []


def fail(msg):
    print("FAIL: " + msg)
    FAILS.append(msg)


def conf_keys(text):
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def check_podmonitor(o, where):
    spec = o.get("spec", {})
    eps = spec.get("podMetricsEndpoints")
    if not isinstance(spec.get("selector"), dict) or not eps:
        fail("%s: PodMonitor %s needs spec.selector and spec.podMetricsEndpoints" % (where, o["metadata"]["name"]))
    for ep in eps or []:
        if not ep.get("port") or not str(ep.get("path", "/metrics")).startswith("/"):
            fail("%s: PodMonitor endpoint %s needs a port name and a path" % (where, ep))


def check_workload(o, objs, tandem, where, tmp):
    spec = o["spec"]["template"]["spec"]
    cms = {x["metadata"]["name"]: x for x in objs if x["kind"] == "ConfigMap"}
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec["containers"]:
        args = list(c.get("args", []))
        if not args or args[0] not in ROLES:
            continue
        role = args[0]
        env = {e["name"]: "10.1.2.3" if "IP" in e["name"] else "tandem-%s-7d9f" % role for e in c.get("env", [])}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]
        conf = {}
        if "--config" in argv:
            i = argv.index("--config") + 1
            mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == argv[i]), None)
            vol = vols.get(mount["name"]) if mount else None
            cm = cms.get(vol["configMap"]["name"]) if vol and "configMap" in vol else None
            text = cm["data"].get(mount.get("subPath", "")) if cm else None
            if text is None:
                fail("%s: %s: --config %s is no file of a ConfigMap mounted there" % (where, c["name"], argv[i]))
                continue
            path = os.path.join(tmp, "%s-%s.conf" % (o["metadata"]["name"], role))
            with open(path, "w") as f:
                f.write(text)
            argv[i] = path
            conf = conf_keys(text)
        left = [a for a in argv if "$(" in a]
        if left:
            fail("%s: %s: %s names no env variable of the container" % (where, c["name"], left))
        r = subprocess.run([tandem] + argv + ["--check-config"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            fail("%s: %s: `tandem %s` refuses its flags or config: %s" % (where, c["name"], " ".join(args),
                                                                        (r.stderr or r.stdout).strip()[-400:]))
        ports = {p["containerPort"] for p in c.get("ports", [])}
        want = int(conf.get("port", 0))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            g = c.get(probe, {}).get("grpc")
            if role != "router" and not g:
                fail("%s: %s has no gRPC %s" % (where, c["name"], probe)) if probe != "startupProbe" else None
            if g and g["port"] != want:
                fail("%s: %s: %s on port %s, but the config's port is %s" % (where, c["name"], probe, g["port"], want))
            if g and role != "router" and g.get("service", "") not in ("", "liveness"):
                fail("%s: %s: %s asks service %s" % (where, c["name"], probe, g.get("service")))
        for k in ("port", "metrics-port", "control-port", "http-port"):
            if k in conf and int(conf[k]) not in ports:
                fail("%s: %s: the config's %s %s is no containerPort" % (where, c["name"], k, conf[k]))
        ann = o["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/port") != conf.get("metrics-port"):
            fail("%s: %s: prometheus.io/port %s, metrics-port %s" % (where, c["name"], ann.get("prometheus.io/port"),
                                                                   conf.get("metrics-port")))
        if role != "router":
            drain_s = int(conf.get("drain-timeout-ms", 300000)) / 1000
            grace = spec.get("terminationGracePeriodSeconds", 30)
            if grace <= drain_s:
                fail("%s: %s: terminationGracePeriodSeconds %s does not exceed drain-timeout-ms (%g s)"
                     % (where, c["name"], grace, drain_s))
        print("  %s %s: `tandem %s` accepts its flags and config; probes and ports agree"
              % (o["kind"], o["metadata"]["name"], role))


def main():
    tandem, version, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        for d in dirs:
            where = os.path.relpath(d)
            try:
                objs = render.render(d)
            except render.RenderError as e:
                fail("%s: %s" % (where, e))
                continue
            print("%s: %d objects" % (where, len(objs)))
            for o in objs:
                if o["kind"] == "PodMonitor":
                    check_podmonitor(o, where)
                else:
                    try:
                        kubernetes_validate.validate(o, version, strict=True)
                    except kubernetes_validate.ValidationError as e:
                        fail("%s: %s %s: %s (at %s)" % (where, o["kind"], o["metadata"]["name"], e.message,
                                                         "/".join(str(p) for p in e.path)))
                        continue
                    except Exception as e:  # SchemaNotFoundError, InvalidSchemaError, ...
                        fail("%s: %s %s: %s" % (where, o["kind"], o["metadata"]["name"], e))
                        continue
                print("  %s %s: valid (Kubernetes %s)" % (o["kind"], o["metadata"]["name"], version))
                if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
                    check_workload(o, objs, tandem, where, tmp)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
