#!/usr/bin/env python3
"""Mock EC2 instance metadata service (IMDS) for tests and manual drain testing.

Serves EC2's paths, headers and status codes with IMDSv2 session tokens (and their
expiry), scripts Spot notices, rebalance recommendations, Auto Scaling lifecycle changes,
scheduled maintenance and faults at run time through /_mock/* (DESIGN.md), and binds to
loopback only. Python 3 standard library alone. Start options follow
amazon-ec2-metadata-mock where they overlap (port 1338, -d, -x, --rebalance-*, -I).
"""

import argparse
import datetime as dt
import functools
import json
import os
import secrets
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

TOKEN_TTL_HDR = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HDR = "X-aws-ec2-metadata-token"


@functools.lru_cache(maxsize=None)
def huge_body():
    """The "huge" fault's reply, built once, on the first request that asks for it (not at
    start: most runs never do). Built per request (16 MiB of copies, ~35 ms of CPU) it came
    later than a client's 500 ms on a loaded box, each retry building it again, and the
    client saw a timeout where it should have refused an oversized reply."""
    return b'{"action":"terminate","pad":"' + b"x" * (8 << 20) + b'"}'


FAULT_KINDS = ("delay", "500", "503", "429", "drop", "badbody", "truncated", "huge",
               "wrongtypes", "notoken", "token400", "tokenhang")

NOT_FOUND_HTML = (b'<?xml version="1.0" encoding="iso-8859-1"?>\n'
                  b'<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"\n'
                  b'\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">\n'
                  b'<html><head><title>404 - Not Found</title></head>\n'
                  b'<body><h1>404 - Not Found</h1></body></html>\n')


def rfc3339(t):
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def maint_time(t):
    # EC2 writes scheduled-event times as "21 Jan 2019 09:00:43 GMT"
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%d %b %Y %H:%M:%S GMT")


def parse_when(s):
    """RFC 3339 (or a bare epoch) to epoch seconds."""
    try:
        return float(s)
    except ValueError:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


class State:
    """Everything the mock serves, guarded by one lock."""

    def __init__(self, a):
        self.lock = threading.Lock()
        self.imdsv2_only = a.imdsv2
        self.max_ttl = 21600
        self.tokens = {}  # token -> expiry (monotonic)
        self.counts = {"put": 0, "get": 0, "401": 0, "control": 0, "iam": 0}
        self.paths = {}  # GETs by path, as received (a client's retries included)
        self.identity = {
            "instance-id": a.instance_id,
            "instance-type": a.instance_type,
            "placement/availability-zone": a.az,
            "placement/region": a.az[:-1] if a.az[-1:].isalpha() else a.az,
            "instance-life-cycle": "spot",
            "ami-id": "ami-0123456789abcdef0",
            "hostname": "ip-127-0-0-1.ec2.internal",
            "local-ipv4": "127.0.0.1",
        }
        self.spot = None  # dict(appear, action, time or None, raw_time, moving)
        self.rebalance = None  # dict(appear, time)
        self.lifecycle = a.lifecycle
        self.maintenance = []  # list of dicts
        self.fault = None  # dict(kind, until, path, ms)
        now = time.time()
        self.iam = None  # dict(role, AccessKeyId, SecretAccessKey, Token, expires): the profile
        if a.iam_role:
            self.set_iam(a.iam_role, a.iam_access_key_id, a.iam_secret_access_key,
                         a.iam_token, a.iam_expires_in, now)
        if a.mock_delay_sec is not None or a.mock_trigger_time or a.spot:
            appear = now + (a.mock_delay_sec or 0)
            if a.mock_trigger_time:
                appear = parse_when(a.mock_trigger_time)
            self.spot = {"appear": appear, "action": a.spot_action,
                         "time": parse_when(a.spot_time) if a.spot_time else None,
                         "raw_time": None, "moving": a.spot_time is None}
        if a.rebalance_delay_sec is not None or a.rebalance_trigger_time:
            appear = now + (a.rebalance_delay_sec or 0)
            if a.rebalance_trigger_time:
                appear = parse_when(a.rebalance_trigger_time)
            self.rebalance = {"appear": appear}
        if a.maintenance:
            self.add_maintenance(a.maintenance, now + 3 * 86400)

    def set_iam(self, role, key, secret, token, expires_in, now):
        self.iam = {"role": role, "AccessKeyId": key, "SecretAccessKey": secret,
                    "Token": token, "expires": now + float(expires_in),
                    "updated": now}

    def add_maintenance(self, code, start):
        ev = {"Code": code, "Description": "The instance is scheduled for %s" % code,
              "EventId": "instance-event-%s" % secrets.token_hex(8),
              "NotBefore": maint_time(start), "NotAfter": maint_time(start + 7200),
              "NotBeforeDeadline": maint_time(start + 7 * 86400), "State": "active"}
        self.maintenance.append(ev)
        return ev

    def snapshot(self):
        now = time.time()
        f = self.fault
        return {
            "counts": dict(self.counts),
            "paths": dict(self.paths),
            "tokens": len(self.tokens),
            "imdsv2_only": self.imdsv2_only,
            "spot": None if not self.spot else {
                "appear": rfc3339(self.spot["appear"]), "appear_epoch": self.spot["appear"],
                "visible": now >= self.spot["appear"], "action": self.spot["action"]},
            "rebalance": None if not self.rebalance else {
                "appear_epoch": self.rebalance["appear"],
                "visible": now >= self.rebalance["appear"]},
            "lifecycle": self.lifecycle,
            "iam_role": self.iam["role"] if self.iam else None,
            "maintenance": self.maintenance,
            "fault": None if not f or time.monotonic() >= f["until"] else {
                "kind": f["kind"], "path": f["path"],
                "left_s": round(f["until"] - time.monotonic(), 3)},
        }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as EC2's IMDS
    server_version = "EC2ws"
    sys_version = ""

    def setup(self):
        super().setup()
        # headers and body go out in two writes: without this, Nagle and the client's
        # delayed ACK add 40 ms to every reply (EC2's IMDS answers in well under 1 ms)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        if self.server.verbose:
            sys.stderr.write("mock-imds: %s %s\n" % (self.address_string(), fmt % args))

    # ---- plumbing ------------------------------------------------------------------
    def send(self, code, body=b"", ctype="text/plain", extra=None):
        if isinstance(body, str):
            body = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def drop(self):
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def active_fault(self, path):
        st = self.server.state
        with st.lock:
            f = st.fault
            if not f:
                return None
            if time.monotonic() >= f["until"]:
                st.fault = None
                return None
            if f["path"] and not path.startswith(f["path"]):
                return None
            return dict(f)

    def read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(min(n, 1 << 16))

    # ---- verbs ---------------------------------------------------------------------
    def do_PUT(self):
        self.read_body()
        path = urlparse(self.path).path
        if path != "/latest/api/token":
            return self.send(405 if path.startswith("/latest/") else 404, NOT_FOUND_HTML,
                             "text/html")
        st = self.server.state
        with st.lock:
            st.counts["put"] += 1
        f = self.active_fault(path)
        if f:
            if f["kind"] == "notoken":
                return self.send(403, "Forbidden")
            if f["kind"] == "token400":
                return self.send(400, "Bad Request")
            if f["kind"] == "tokenhang":
                time.sleep(f["ms"] / 1000.0)
                return self.drop()
            if f["kind"] in ("500", "503", "429", "drop", "delay"):
                if self.apply_transport_fault(f):
                    return
        if self.headers.get("X-Forwarded-For"):
            return self.send(403, "Forbidden")  # EC2 refuses tokens through a proxy
        ttl = self.headers.get(TOKEN_TTL_HDR)
        try:
            ttl = int(ttl)
        except (TypeError, ValueError):
            return self.send(400, "Bad Request")
        if ttl < 1 or ttl > 21600:
            return self.send(400, "Bad Request")
        with st.lock:
            ttl = min(ttl, st.max_ttl)
            tok = "AQAEA" + secrets.token_urlsafe(40)
            st.tokens[tok] = time.monotonic() + ttl
        self.send(200, tok, extra={TOKEN_TTL_HDR: str(ttl)})

    def do_POST(self):
        self.read_body()
        u = urlparse(self.path)
        if not u.path.startswith("/_mock/"):
            return self.send(405 if u.path.startswith("/latest/") else 404, NOT_FOUND_HTML,
                             "text/html")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        try:
            out = self.control(u.path[len("/_mock/"):], q)
        except (ValueError, KeyError) as e:
            return self.send(400, json.dumps({"error": str(e)}) + "\n", "application/json")
        if out is None:
            return self.send(404, json.dumps({"error": "no such control"}) + "\n",
                             "application/json")
        self.send(200, json.dumps(out) + "\n", "application/json")

    def do_GET(self):
        u = urlparse(self.path)
        st = self.server.state
        if u.path == "/_mock/state":
            with st.lock:
                return self.send(200, json.dumps(st.snapshot()) + "\n", "application/json")
        with st.lock:
            st.counts["get"] += 1
            st.paths[u.path] = st.paths.get(u.path, 0) + 1
        f = self.active_fault(u.path)
        if f and self.apply_transport_fault(f):
            return
        tok = self.headers.get(TOKEN_HDR)
        with st.lock:
            if tok is not None:
                exp = st.tokens.get(tok)
                ok = exp is not None and exp > time.monotonic()
                if not ok:
                    st.tokens.pop(tok, None)
            else:
                ok = not st.imdsv2_only
            if not ok:
                st.counts["401"] += 1
        if not ok:
            return self.send(401, "Unauthorized")
        code, body, ctype = self.metadata(u.path)
        if code == 200 and f and u.path.startswith("/latest/meta-data/"):
            return self.hostile_body(f, body)
        self.send(code, body, ctype)

    do_HEAD = do_GET

    # ---- faults --------------------------------------------------------------------
    def apply_transport_fault(self, f):
        """Faults that replace the answer; True when the request was answered."""
        k = f["kind"]
        if k == "delay":
            time.sleep(f["ms"] / 1000.0)
            return False
        if k in ("500", "503"):
            self.send(int(k), "Internal Server Error" if k == "500" else "Service Unavailable")
            return True
        if k == "429":
            self.send(429, "Too Many Requests", extra={"Retry-After": "1"})
            return True
        if k == "drop":
            self.drop()
            return True
        return False

    def hostile_body(self, f, body):
        k = f["kind"]
        if k == "badbody":
            return self.send(200, "<html>captive portal</html>{\"action\":", "text/plain")
        if k == "wrongtypes":
            return self.send(200, '{"action": 7, "time": ["soon"], "noticeTime": false}',
                             "text/plain")
        if k == "huge":
            return self.send(200, huge_body(), "text/plain")
        if k == "truncated":
            data = body.encode() if isinstance(body, str) else body
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data) + 64))
            self.end_headers()
            self.wfile.write(data[: max(1, len(data) // 2)])
            self.wfile.flush()
            return self.drop()
        return self.send(200, body, "text/plain")

    # ---- what EC2 serves -----------------------------------------------------------
    def metadata(self, path):
        st = self.server.state
        now = time.time()
        with st.lock:
            if path in ("/latest/meta-data/spot/instance-action",
                        "/latest/meta-data/spot/termination-time"):
                s = st.spot
                if not s or now < s["appear"]:
                    return 404, NOT_FOUND_HTML, "text/html"
                if s["raw_time"] is not None:
                    t = s["raw_time"]
                elif s["moving"]:
                    # amazon-ec2-metadata-mock's default: two minutes from every request
                    t = rfc3339(now + 120)
                else:
                    t = rfc3339(s["time"])
                if path.endswith("termination-time"):
                    return 200, t, "text/plain"
                return 200, json.dumps({"action": s["action"], "time": t}), "text/plain"
            if path == "/latest/meta-data/events/recommendations/rebalance":
                r = st.rebalance
                if not r or now < r["appear"]:
                    return 404, NOT_FOUND_HTML, "text/html"
                return 200, json.dumps({"noticeTime": rfc3339(r["appear"])}), "text/plain"
            if path == "/latest/meta-data/autoscaling/target-lifecycle-state":
                if st.lifecycle is None:
                    return 404, NOT_FOUND_HTML, "text/html"
                return 200, st.lifecycle, "text/plain"
            if path == "/latest/meta-data/events/maintenance/scheduled":
                return 200, json.dumps(st.maintenance, indent=2), "text/plain"
            if path == "/latest/dynamic/instance-identity/document":
                doc = {"instanceId": st.identity["instance-id"],
                       "instanceType": st.identity["instance-type"],
                       "availabilityZone": st.identity["placement/availability-zone"],
                       "region": st.identity["placement/region"],
                       "imageId": st.identity["ami-id"], "architecture": "x86_64",
                       "accountId": "123456789012", "privateIp": "127.0.0.1"}
                return 200, json.dumps(doc, indent=2), "text/plain"
            if path in ("/latest/meta-data/iam/security-credentials",
                        "/latest/meta-data/iam/security-credentials/"):
                if not st.iam:
                    return 404, NOT_FOUND_HTML, "text/html"
                return 200, st.iam["role"], "text/plain"
            if path.startswith("/latest/meta-data/iam/security-credentials/"):
                role = path[len("/latest/meta-data/iam/security-credentials/"):]
                if not st.iam or role != st.iam["role"]:
                    return 404, NOT_FOUND_HTML, "text/html"
                st.counts["iam"] += 1
                doc = {"Code": "Success", "LastUpdated": rfc3339(st.iam["updated"]),
                       "Type": "AWS-HMAC", "AccessKeyId": st.iam["AccessKeyId"],
                       "SecretAccessKey": st.iam["SecretAccessKey"], "Token": st.iam["Token"],
                       "Expiration": rfc3339(st.iam["expires"])}
                return 200, json.dumps(doc, indent=2), "text/plain"
            if path == "/latest/meta-data/iam/info":
                if not st.iam:
                    return 404, NOT_FOUND_HTML, "text/html"
                doc = {"Code": "Success", "LastUpdated": rfc3339(st.iam["updated"]),
                       "InstanceProfileArn": "arn:aws:iam::123456789012:instance-profile/"
                       + st.iam["role"],
                       "InstanceProfileId": "AIPAEXAMPLEPROFILEID0"}
                return 200, json.dumps(doc, indent=2), "text/plain"
            if path.startswith("/latest/meta-data/"):
                key = path[len("/latest/meta-data/"):]
                if key in st.identity:
                    return 200, st.identity[key], "text/plain"
                if key in ("", "/"):
                    return 200, "\n".join(sorted(st.identity)), "text/plain"
        return 404, NOT_FOUND_HTML, "text/html"

    # ---- control -------------------------------------------------------------------
    def control(self, what, q):
        st = self.server.state
        now = time.time()
        with st.lock:
            st.counts["control"] += 1
            if what == "spot":
                appear = now + float(q.get("in", 0))
                action = q.get("action", "terminate")
                s = {"appear": appear, "action": action, "raw_time": None, "moving": False}
                if "rawtime" in q:  # served verbatim, for unparsable-time tests
                    s["raw_time"] = q["rawtime"]
                    s["time"] = None
                elif "time" in q:
                    s["time"] = parse_when(q["time"])
                elif q.get("moving") in ("1", "true"):
                    s["time"] = None
                    s["moving"] = True
                else:
                    s["time"] = appear + 120
                st.spot = s
                return {"spot": "armed", "appear": rfc3339(appear), "appear_epoch": appear,
                        "action": action,
                        "time": s["raw_time"] or (rfc3339(s["time"]) if s["time"] else None)}
            if what == "rebalance":
                appear = now + float(q.get("in", 0))
                st.rebalance = {"appear": appear}
                return {"rebalance": "armed", "appear_epoch": appear}
            if what == "lifecycle":
                state = q["state"]
                st.lifecycle = None if state == "none" else state
                return {"lifecycle": st.lifecycle}
            if what == "maintenance":
                if q.get("cancel"):
                    for ev in st.maintenance:
                        if ev["EventId"] == q["cancel"] or q["cancel"] == "all":
                            ev["State"] = "canceled"
                    return {"maintenance": st.maintenance}
                if q.get("remove"):
                    st.maintenance = [e for e in st.maintenance
                                      if q["remove"] not in (e["EventId"], "all")]
                    return {"maintenance": st.maintenance}
                ev = st.add_maintenance(q.get("code", "system-reboot"),
                                        now + float(q.get("in", 3 * 86400)))
                return {"maintenance": "scheduled", "event": ev}
            if what == "fault":
                kind = q["kind"]
                if kind not in FAULT_KINDS:
                    raise ValueError("kind must be one of " + "|".join(FAULT_KINDS))
                st.fault = {"kind": kind, "until": time.monotonic() + float(q.get("for", 5)),
                            "path": q.get("path", ""), "ms": int(q.get("ms", 3000))}
                return {"fault": kind, "for": float(q.get("for", 5))}
            if what == "iam":  # the instance profile's credentials; role=none: no profile
                if q.get("role") == "none":
                    st.iam = None
                    return {"iam": None}
                cur = st.iam or {}
                st.set_iam(q.get("role", cur.get("role", "rolloutd-node")),
                           q.get("key", cur.get("AccessKeyId", "ASIAMOCKIMDSKEY00001")),
                           q.get("secret", cur.get("SecretAccessKey", "mock-imds-secret")),
                           q.get("token", cur.get("Token", "mock-imds-session-token")),
                           q.get("expires_in", 21600), now)
                return {"iam": st.iam["role"], "expiration": rfc3339(st.iam["expires"])}
            if what == "revoke":  # every token becomes invalid: clients see 401
                n = len(st.tokens)
                st.tokens.clear()
                return {"revoked": n}
            if what == "token":
                st.max_ttl = int(q.get("max_ttl", 21600))
                return {"max_ttl": st.max_ttl}
            if what == "imdsv2":
                st.imdsv2_only = q.get("only", "1") in ("1", "true")
                return {"imdsv2_only": st.imdsv2_only}
            if what == "clear":
                st.spot = None
                st.rebalance = None
                st.fault = None
                if q.get("all"):
                    st.maintenance = []
                    st.lifecycle = "InService"
                return {"cleared": True}
        return None


def main():
    p = argparse.ArgumentParser(
        prog="rolloutctl imds mock",
        description="Mock EC2 IMDS on loopback (see README: Testing a drain by hand).")
    p.add_argument("-n", "--hostname", default="127.0.0.1",
                   help="address to bind; only loopback addresses are accepted")
    p.add_argument("-p", "--port", type=int, default=1338, help="0 picks a free port")
    p.add_argument("-I", "--imdsv2", action="store_true",
                   help="require IMDSv2 session tokens (401 without one)")
    p.add_argument("-d", "--mock-delay-sec", type=float, default=None,
                   help="spot notice appears this many seconds after start")
    p.add_argument("-x", "--mock-trigger-time", default=None,
                   help="spot notice appears at this RFC 3339 time")
    p.add_argument("--spot", action="store_true", help="serve a spot notice (at once)")
    p.add_argument("-a", "--spot-action", default="terminate",
                   choices=("terminate", "stop", "hibernate"))
    p.add_argument("-t", "--spot-time", default=None,
                   help="termination time (RFC 3339); default: 2 minutes from each request")
    p.add_argument("--rebalance-delay-sec", type=float, default=None)
    p.add_argument("--rebalance-trigger-time", default=None)
    p.add_argument("--lifecycle", default="InService",
                   help="autoscaling/target-lifecycle-state ('none': not in an ASG)")
    p.add_argument("--maintenance", default=None, metavar="CODE",
                   help="a scheduled event (system-reboot, instance-stop, ...)")
    p.add_argument("--instance-id", default="i-0123456789abcdef0")
    p.add_argument("--instance-type", default="p5en.48xlarge")
    p.add_argument("--az", default="us-east-1a")
    p.add_argument("--iam-role", default=None,
                   help="serve an instance profile with this role (iam/security-credentials/)")
    p.add_argument("--iam-access-key-id", default="ASIAMOCKIMDSKEY00001")
    p.add_argument("--iam-secret-access-key", default="mock-imds-secret")
    p.add_argument("--iam-token", default="mock-imds-session-token")
    p.add_argument("--iam-expires-in", type=float, default=21600,
                   help="the credentials' Expiration, seconds after they are set")
    p.add_argument("--port-file", default=None, help="write the bound port here")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    if a.lifecycle == "none":
        a.lifecycle = None
    host = a.hostname
    if host == "localhost":
        host = "127.0.0.1"
    if not (host.startswith("127.") or host == "::1"):
        p.error("the mock binds to loopback only (127.0.0.0/8 or ::1), not %s" % host)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            # a client that hung up (timeouts, fault tests) is not the mock's error
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    srv = Server((host, a.port), Handler)
    srv.state = State(a)
    srv.verbose = a.verbose
    port = srv.server_address[1]
    if a.port_file:
        tmp = a.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d\n" % port)
        os.rename(tmp, a.port_file)
    print("mock-imds: listening on http://%s:%d" % (
        "[%s]" % host if ":" in host else host, port), flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
