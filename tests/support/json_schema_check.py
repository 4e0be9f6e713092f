# json_schema_check.py SCHEMA.json OUTPUT.txt: exits 0 when OUTPUT parses as JSON and
# validates against SCHEMA, else 1 saying where. Written apart from the grammar compiler
# (common/grammar) so a test of structured output does not check the compiler against
# itself; covers the subset the tests' schemas use (type, enum, properties, required, no
# extra keys, items, maxItems, minLength/maxLength, format email/date, minimum/maximum).
import json, re, sys
schema = json.load(open(sys.argv[1]))
text = open(sys.argv[2]).read()
def fail(why):
    print(why + ": " + repr(text)); sys.exit(1)
try:
    v = json.loads(text)
except Exception as e:
    fail("not JSON (%s)" % e)
def check(s, v, path):
    if "enum" in s:
        if v not in s["enum"]: fail("%s: %r not in enum" % (path, v))
        return
    t = s.get("type")
    ts = t if isinstance(t, list) else [t]
    kind = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v))
    if kind is None: kind = "integer" if isinstance(v, int) else "number"
    if kind not in ts and not (kind == "integer" and "number" in ts): fail("%s: %s is not %s" % (path, kind, t))
    if kind == "object":
        props = s.get("properties", {})
        for r in s.get("required", []):
            if r not in v: fail("%s: required %s missing" % (path, r))
        for k, x in v.items():
            if k not in props: fail("%s: extra key %s" % (path, k))
            check(props[k], x, path + "." + k)
    elif kind == "array":
        if len(v) > s.get("maxItems", 1 << 30): fail("%s: %d items" % (path, len(v)))
        for i, x in enumerate(v): check(s.get("items", {}), x, "%s[%d]" % (path, i))
    elif kind == "string":
        if not (s.get("minLength", 0) <= len(v) <= s.get("maxLength", 1 << 30)): fail("%s: length" % path)
        f = s.get("format")
        if f == "email" and not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", v): fail("%s: not an email" % path)
        if f == "date" and not re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", v): fail("%s: not a date" % path)
    elif kind in ("integer", "number"):
        if v < s.get("minimum", float("-inf")) or v > s.get("maximum", float("inf")): fail("%s: %r out of range" % (path, v))
check(schema, v, "$")
