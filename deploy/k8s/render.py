#!/usr/bin/env python3
"""render.py: renders a kustomization of deploy/k8s (base or an overlay) the way
`kubectl kustomize` does, for the subset of Kustomize these files use, so that they are
checked where kustomize is not installed (it is no Debian package). Prints the objects as
one multi-document YAML stream, or with --json as a JSON list.

Supported kustomization keys: resources (files and kustomization directories), labels
(pairs; includeSelectors / includeTemplates), images (name, newName, newTag), replicas,
patches (path or inline patch: strategic merge, matched by kind and name; lists of objects
with a `name` merge by name, other lists are replaced), namespace. Any other key is an
error: a file using a feature this renderer ignores must not pass as checked.

Usage: render.py DIR [--json]
Needs PyYAML (python3-yaml).
"""
import copy
import json
import os
import sys

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "labels", "images", "replicas", "patches", "namespace"}


class RenderError(Exception):
    pass


def load_docs(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "metadata" not in d:
            raise RenderError("%s: a document without kind or metadata" % path)
    return docs


def merge(base, patch):
    """Strategic merge, as far as these files need it."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            for i, x in enumerate(out):
                if x["name"] == item["name"]:
                    out[i] = merge(x, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def key(obj):
    return obj["kind"], obj["metadata"]["name"]


def containers(obj):
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def render(d):
    path = os.path.join(d, "kustomization.yaml")
    if not os.path.isfile(path):
        raise RenderError("%s: no kustomization.yaml" % d)
    with open(path) as f:
        k = yaml.safe_load(f) or {}
    unknown = set(k) - SUPPORTED
    if unknown:
        raise RenderError("%s: keys this renderer does not implement: %s" % (path, ", ".join(sorted(unknown))))
    objs = []
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(d, r))
        if os.path.isdir(p):
            objs += render(p)
        elif os.path.isfile(p):
            objs += load_docs(p)
        else:
            raise RenderError("%s: resource %s does not exist" % (path, r))
    seen = set()
    for o in objs:
        if key(o) in seen:
            raise RenderError("%s: %s %s defined twice" % (path, *key(o)))
        seen.add(key(o))
    for p in k.get("patches", []):
        if "target" in p:
            raise RenderError("%s: patches with a target are not implemented" % path)
        docs = load_docs(os.path.join(d, p["path"])) if "path" in p else list(yaml.safe_load_all(p["patch"]))
        for doc in docs:
            idx = [i for i, o in enumerate(objs) if key(o) == key(doc)]
            if not idx:
                raise RenderError("%s: patch for %s %s, which no resource defines" % (path, *key(doc)))
            objs[idx[0]] = merge(objs[idx[0]], doc)
    for lab in k.get("labels", []):
        extra = set(lab) - {"pairs", "includeSelectors", "includeTemplates"}
        if extra:
            raise RenderError("%s: labels keys not implemented: %s" % (path, ", ".join(sorted(extra))))
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
            tmpl = o.get("spec", {}).get("template")
            if tmpl and (lab.get("includeTemplates") or lab.get("includeSelectors")):
                tmpl.setdefault("metadata", {}).setdefault("labels", {}).update(lab["pairs"])
            if lab.get("includeSelectors"):
                sel = o.get("spec", {}).get("selector")
                if isinstance(sel, dict) and "matchLabels" in sel:
                    sel["matchLabels"].update(lab["pairs"])
                elif isinstance(sel, dict) and o["kind"] == "Service":
                    sel.update(lab["pairs"])
    for img in k.get("images", []):
        n = 0
        for o in objs:
            for c in containers(o):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = "%s:%s" % (img.get("newName", name), img.get("newTag", tag or "latest"))
                    n += 1
        if not n:
            raise RenderError("%s: image %s is used by no container" % (path, img["name"]))
    for rep in k.get("replicas", []):
        idx = [o for o in objs if o["metadata"]["name"] == rep["name"] and "replicas" in o.get("spec", {})]
        if not idx:
            raise RenderError("%s: replicas for %s, which no workload defines" % (path, rep["name"]))
        idx[0]["spec"]["replicas"] = rep["count"]
    if "namespace" in k:
        for o in objs:
            o["metadata"]["namespace"] = k["namespace"]
    return objs


def str_presenter(dumper, s):
    """Multi-line strings (the config files) as block literals, as kustomize prints them."""
    style = "|" if "\n" in s else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    try:
        objs = render(argv[1])
    except (RenderError, OSError, yaml.YAMLError, KeyError, TypeError) as e:
        print("render.py: %s" % e, file=sys.stderr)
        return 1
    if "--json" in argv[2:]:
        json.dump(objs, sys.stdout, indent=1)
    else:
        yaml.SafeDumper.add_representer(str, str_presenter)
        yaml.safe_dump_all(objs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
