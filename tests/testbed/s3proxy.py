"""A fault-injecting HTTP proxy between an S3 client and a real S3 server.

The library talks to the proxy as its endpoint (``client_kwargs={"endpoint_url":
proxy.endpoint_url}``); the proxy forwards every request to the real server (moto, see
:mod:`.s3`) and, where a :class:`Rule` matches, injects what object stores and
networks really do:

- ``error``: answer an S3 error (500 ``InternalError``, 503 ``SlowDown``, 412
  ``PreconditionFailed``, 404 ``NoSuchKey``, 501 ``NotImplemented``, ...) without
  forwarding: the store did nothing.
- ``delay``: hold the request before forwarding it, for ``delay_s`` or until the test
  sets ``rule.release`` (an event, so tests order things without sleeps).
- ``drop``: forward the request, let it land, then close the client's connection
  without an answer: the client sees a reset and retries, but the object exists.
- ``cut``: read part of the body, then close the connection before forwarding: an
  upload cut mid-way (nothing lands).
- ``strip``: remove a header (e.g. ``If-None-Match``) before forwarding: a store
  that ignores conditional writes.
- ``call``: run ``rule.callback(request)`` (e.g. SIGKILL the client), then drop
  (or, with ``land=False``, cut).

Pages: moto answers ``ListMultipartUploads`` in one page whatever ``max-uploads``
says. With :attr:`S3Proxy.list_uploads_page` set, the proxy cuts that answer into pages
of at most that many uploads as S3 does (ordered by key, then upload id; ``key-marker``
and ``upload-id-marker`` honoured; ``IsTruncated``, ``NextKeyMarker`` and
``NextUploadIdMarker`` set), so a client that reads only the first page is caught.

Requests are matched by method, request type (:func:`classify`: ``put``,
``put-create`` (a conditional PUT), ``part``, ``mpu-start``, ``mpu-complete``,
``mpu-abort``, ``delete``, ``delete-many``, ``list``, ``list-uploads``, ``head``,
``get``, ...) and a regular expression searched in the object key (for a batch delete,
in any of its keys). Every request is logged (:attr:`S3Proxy.log`) and every injection
counted (:attr:`S3Proxy.injected`), so a test can assert its fault really happened and
a campaign can aim a fault at the n-th request of an operation.

Stdlib only; one thread per client connection; HTTP/1.1 keep-alive towards the client
(botocore and aiohttp pool connections), a fresh connection per request upstream.
Bodies sent with ``Content-Length`` (including ``aws-chunked`` content-encoding, whose
framing is passed through untouched) or ``Transfer-Encoding: chunked`` (de-chunked and
forwarded with a length) are both handled.

Example::

    with S3Server() as s3, S3Proxy(s3) as proxy:
        rule = proxy.add(Rule("drop", method="PUT", key=r"manifest\\.json$"))
        fs = s3fs.S3FileSystem(**proxy.storage_options())
        fs.pipe("bucket/x/checkpoint.manifest.json", b"{}")  # lands; the answer is lost
        assert rule.fired == 1
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import re
import socket
import socketserver
import struct
import threading
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._util import Service
from .s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Server

__all__ = ["ACTIONS", "KINDS", "ProxiedRequest", "Rule", "S3Proxy", "classify"]

ACTIONS = ("error", "delay", "drop", "cut", "strip", "call")
KINDS = (
    "put",
    "put-create",
    "put-conditional",
    "copy",
    "part",
    "mpu-start",
    "mpu-complete",
    "mpu-abort",
    "delete",
    "delete-many",
    "list",
    "list-uploads",
    "head",
    "head-bucket",
    "get",
    "bucket",
    "other",
)

_CODES = {
    400: "InvalidRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    409: "ConditionalRequestConflict",
    412: "PreconditionFailed",
    500: "InternalError",
    501: "NotImplemented",
    503: "SlowDown",
}
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",
    }
)
_KEY_RE = re.compile(rb"<Key>([^<]*)</Key>")
#: A request held by a ``delay`` rule whose event is never set goes on after this.
MAX_HOLD_S = 60.0


@dataclass(frozen=True)
class ProxiedRequest:
    """One request as the proxy saw it.

    Attributes:
        seq: 0, 1, 2, ... in arrival order.
        method: HTTP method.
        kind: request type (:func:`classify`).
        bucket: bucket name ('' for the service).
        key: object key ('' for bucket requests); for ``delete-many``, the first key.
        keys: every key the request names (a batch delete names several).
        headers: the request headers, lower-case names.
    """

    seq: int
    method: str
    kind: str
    bucket: str
    key: str
    keys: tuple[str, ...]
    headers: dict[str, str]


@dataclass
class Rule:
    """What to inject, and into which requests.

    Args:
        action: one of :data:`ACTIONS`.
        method: match only this HTTP method (``PUT``, ``GET``, ...).
        kind: match only this request type (a string or a tuple of them).
        key: regular expression searched in the key (any key of a batch delete).
        skip: let this many matching requests through first.
        times: act on this many matching requests (None: every one, until removed).
        status: the status an ``error`` answers with.
        delay_s: how long a ``delay`` holds a request (with ``release`` unset).
        header: the header a ``strip`` removes.
        cut_fraction: the share of the body a ``cut`` reads before closing.
        callback: what a ``call`` runs, with the :class:`ProxiedRequest`.
        when: extra predicate on the :class:`ProxiedRequest`.
        hold: a ``strip``, ``drop`` or ``call`` first holds the request, as a
            ``delay`` does (e.g. a stripped create that lands only after another).
        land: after its callback, a ``call`` forwards the request (it lands, the
            answer is lost) or, with False, cuts it (it never lands).

    Attributes:
        fired: how many requests it acted on.
        arrived: set when it first acts (a test waits on it instead of sleeping).
        release: a ``delay`` rule holds its requests until this is set (or
            ``delay_s``, if given, passes; at most :data:`MAX_HOLD_S`).
        done: set when a ``delay``'s held request was forwarded and answered, or when
            a ``drop``'s request landed upstream.
        requests: the requests it acted on.
    """

    action: str
    method: str | None = None
    kind: str | tuple[str, ...] | None = None
    key: str | None = None
    skip: int = 0
    times: int | None = 1
    status: int = 503
    delay_s: float | None = None
    header: str = "If-None-Match"
    cut_fraction: float = 0.5
    callback: Callable[[ProxiedRequest], None] | None = None
    when: Callable[[ProxiedRequest], bool] | None = None
    hold: bool = False
    land: bool = True
    fired: int = 0
    seen: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    requests: list[ProxiedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {ACTIONS}")
        kinds = (self.kind,) if isinstance(self.kind, str) else self.kind or ()
        for k in kinds:
            if k not in KINDS:
                raise ValueError(f"unknown request kind {k!r}; one of {KINDS}")
        self._key_re = re.compile(self.key) if self.key is not None else None

    def _matches(self, req: ProxiedRequest) -> bool:
        if self.method is not None and req.method != self.method.upper():
            return False
        if self.kind is not None:
            kinds = (self.kind,) if isinstance(self.kind, str) else self.kind
            if req.kind not in kinds:
                return False
        if self._key_re is not None and not any(self._key_re.search(k) for k in req.keys):
            return False
        return self.when is None or bool(self.when(req))

    def _claim(self, req: ProxiedRequest) -> bool:
        """Called under the proxy's lock: whether this rule acts on ``req``."""
        if self.times is not None and self.fired >= self.times:
            return False
        if not self._matches(req):
            return False
        self.seen += 1
        if self.seen <= self.skip:
            return False
        self.fired += 1
        self.requests.append(req)
        return True


def classify(method: str, path: str, headers: dict[str, str]) -> tuple[str, str, str]:
    """``(kind, bucket, key)`` of a path-style S3 request."""
    url = urllib.parse.urlsplit(path)
    parts = url.path.lstrip("/").split("/", 1)
    bucket = urllib.parse.unquote(parts[0])
    key = urllib.parse.unquote(parts[1]) if len(parts) > 1 else ""
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    method = method.upper()
    if not key:
        if method == "GET" and "uploads" in query:
            return "list-uploads", bucket, key
        if method == "GET" and bucket:
            return "list", bucket, key
        if method == "HEAD":
            return "head-bucket", bucket, key
        if method == "POST" and "delete" in query:
            return "delete-many", bucket, key
        return "bucket", bucket, key
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "part", bucket, key
        if "x-amz-copy-source" in headers:
            return "copy", bucket, key
        if headers.get("if-none-match", "").strip() == "*":
            return "put-create", bucket, key
        if "if-match" in headers or "if-none-match" in headers:
            return "put-conditional", bucket, key
        return "put", bucket, key
    if method == "POST":
        if "uploads" in query:
            return "mpu-start", bucket, key
        if "uploadId" in query:
            return "mpu-complete", bucket, key
        return "other", bucket, key
    if method == "DELETE":
        return ("mpu-abort" if "uploadId" in query else "delete"), bucket, key
    if method == "HEAD":
        return "head", bucket, key
    if method == "GET":
        return "get", bucket, key
    return "other", bucket, key


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: S3Proxy


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the proxy keeps its own log

    def setup(self) -> None:
        super().setup()
        with self.server.proxy._lock:
            self.server.proxy._conns.add(self.connection)

    def finish(self) -> None:
        with self.server.proxy._lock:
            self.server.proxy._conns.discard(self.connection)
        super().finish()

    def _do(self) -> None:
        self.server.proxy._handle(self)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _do

    # -- helpers used by S3Proxy._handle -------------------------------------
    def read_body(self, limit: int | None = None) -> bytes:
        """The request body; with ``limit``, at most that many bytes of it."""
        te = self.headers.get("Transfer-Encoding", "").lower()
        if "chunked" in te:
            out = bytearray()
            while limit is None or len(out) < limit:
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    # Trailers, up to the empty line.
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                out += self.rfile.read(size)
                self.rfile.readline(65537)  # CRLF after the chunk
            return bytes(out)
        length = int(self.headers.get("Content-Length") or 0)
        if limit is not None:
            length = min(length, limit)
        return self.rfile.read(length) if length else b""

    def body_length(self) -> int:
        return int(self.headers.get("Content-Length") or 0)

    def abort_connection(self) -> None:
        """Close the client's connection at once, with a reset (SO_LINGER 0): what a
        network cut or a load balancer dropping the connection looks like."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        # The stdlib's finish() would flush into the closed socket: make it a no-op.
        self.wfile = _Sink()


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    closed = False


class S3Proxy(Service):
    """The proxy in front of ``server``, on 127.0.0.1 and a free port, in a thread.

    Args:
        server: the started :class:`~tests.testbed.s3.S3Server` (or anything with
            ``host`` and ``port``).
        lifetime_s: the proxy shuts itself down after this long even if the test
            forgets to close it (bounded lifetime; held requests are released).
    """

    def __init__(self, server: S3Server | Any, *, lifetime_s: float = 900.0):
        self.upstream = (server.host, int(server.port))
        self.lifetime_s = lifetime_s
        self.host = "127.0.0.1"
        self.port = 0
        self.log: list[tuple[ProxiedRequest, str]] = []
        self.injected: list[tuple[str, ProxiedRequest]] = []
        self._rules: list[Rule] = []
        self._conns: set[socket.socket] = set()  # open client connections
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # requests being handled
        self._seq = 0
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        #: Cut ``ListMultipartUploads`` answers into pages of at most this many uploads
        #: (None: as the server answers; moto: everything in one page).
        self.list_uploads_page: int | None = None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        httpd = _Server((self.host, 0), _Handler)
        httpd.proxy = self
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self._timer = threading.Timer(self.lifetime_s, self.close)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """Stops serving; every held request is released first, and the clients'
        kept-alive connections are closed (no handler thread outlives the proxy)."""
        with self._lock:
            rules, self._rules = self._rules, []
        for rule in rules:
            rule.release.set()
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        with self._idle:
            # Released requests finish first (bounded), then idle connections go.
            self._idle.wait_for(lambda: self._busy == 0, timeout=10)
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._timer is not None:
            self._timer.cancel()

    # -- configuration -----------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def storage_options(self, *, max_attempts: int | None = None) -> dict[str, Any]:
        """fsspec/s3fs ``storage_options`` that go through the proxy.

        Args:
            max_attempts: botocore's attempts per request (its default retries a
                failed request up to 4 times, with back-off of up to seconds).
        """
        opts: dict[str, Any] = {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "use_listings_cache": False,
        }
        if max_attempts is not None:
            opts["config_kwargs"] = {
                "retries": {"total_max_attempts": max_attempts, "mode": "legacy"}
            }
        return opts

    def add(self, rule: Rule) -> Rule:
        """Arms ``rule`` (after those already armed: the first that claims a request
        acts on it)."""
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)
        rule.release.set()

    def clear(self) -> None:
        """Disarms every rule and releases what they hold; the log stays."""
        with self._lock:
            rules, self._rules = self._rules, []
        for rule in rules:
            rule.release.set()

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()
            self.injected.clear()

    @property
    def requests(self) -> list[ProxiedRequest]:
        with self._lock:
            return [r for r, _ in self.log]

    def counts(self) -> dict[str, int]:
        """Injections so far, by ``"<action> <kind>"``."""
        out: dict[str, int] = {}
        with self._lock:
            for action, req in self.injected:
                name = f"{action} {req.kind}"
                out[name] = out.get(name, 0) + 1
        return out

    # -- the work ------------------------------------------------------------------
    def _handle(self, h: _Handler) -> None:
        headers = {k.lower(): v for k, v in h.headers.items()}
        kind, bucket, key = classify(h.command, h.path, headers)
        body: bytes | None = None
        keys: tuple[str, ...] = (key,)
        if kind == "delete-many":
            body = h.read_body()
            keys = tuple(
                urllib.parse.unquote(m.decode("utf-8", "replace")) for m in _KEY_RE.findall(body)
            ) or ("",)
            key = keys[0]
        with self._lock:
            req = ProxiedRequest(self._seq, h.command, kind, bucket, key, keys, headers)
            self._seq += 1
            self._busy += 1
            rule = next((r for r in self._rules if r._claim(req)), None)
            if rule is not None:
                self.injected.append((rule.action, req))
        outcome = "forwarded"
        try:
            if rule is None:
                outcome = self._forward(h, req, body)
                return
            rule.arrived.set()
            outcome = rule.action
            if rule.hold and rule.action in ("strip", "drop", "call"):
                if body is None:
                    body = h.read_body()
                rule.release.wait(MAX_HOLD_S if rule.delay_s is None else rule.delay_s)
            if rule.action == "error":
                if body is None:
                    h.read_body()
                self._answer_error(h, req, rule.status)
            elif rule.action == "cut":
                n = int(h.body_length() * rule.cut_fraction) if body is None else 0
                if body is None:
                    h.read_body(limit=n)
                h.abort_connection()
            elif rule.action == "delay":
                if body is None:
                    body = h.read_body()
                wait = MAX_HOLD_S if rule.delay_s is None else min(rule.delay_s, MAX_HOLD_S)
                rule.release.wait(wait)
                outcome = "delay " + self._forward(h, req, body)
                rule.done.set()
            elif rule.action == "strip":
                drop = rule.header.lower()
                h.headers = _without(h.headers, drop)
                outcome = "strip " + self._forward(h, req, body)
            elif rule.action in ("drop", "call"):
                if rule.action == "call" and rule.callback is not None:
                    rule.callback(req)
                if rule.action == "call" and not rule.land:
                    h.abort_connection()
                    outcome = "call (cut)"
                    return
                status = self._forward(h, req, body, answer=False)
                outcome = f"{rule.action} (upstream {status})"
                rule.done.set()
                h.abort_connection()
        except (OSError, http.client.HTTPException) as exc:
            outcome = f"proxy failed: {type(exc).__name__}: {exc}"
            h.close_connection = True
        finally:
            with self._idle:
                self.log.append((req, outcome))
                self._busy -= 1
                self._idle.notify_all()

    def _forward(
        self, h: _Handler, req: ProxiedRequest, body: bytes | None, *, answer: bool = True
    ) -> str:
        """Sends the request upstream and (with ``answer``) the response back; returns
        the upstream status as text."""
        if body is None:
            body = h.read_body()
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            conn.putrequest(h.command, h.path, skip_host=True, skip_accept_encoding=True)
            for name, value in h.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            if body or h.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
        finally:
            conn.close()
        if status == 200 and req.kind == "list-uploads" and self.list_uploads_page:
            data = _uploads_page(data, h.path, self.list_uploads_page)
        if answer:
            h.send_response_only(status, reason)
            length_sent = False
            for name, value in resp_headers:
                low = name.lower()
                if low == "content-length":
                    if h.command == "HEAD":
                        h.send_header(name, value)
                        length_sent = True
                    continue
                if low in _HOP_BY_HOP:
                    continue
                h.send_header(name, value)
            if not length_sent:
                h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD" and data:
                h.wfile.write(data)
            h.wfile.flush()
        return str(status)

    def _answer_error(self, h: _Handler, req: ProxiedRequest, status: int) -> None:
        code = _CODES.get(status, "InternalError")
        extra = ""
        if status == 412:
            cond = "If-None-Match" if "if-none-match" in req.headers else "If-Match"
            extra = f"<Condition>{cond}</Condition>"
        request_id = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by the test proxy: {code} for "
            f"{req.method} {req.key or req.bucket}</Message>{extra}"
            f"<Resource>/{req.bucket}/{req.key}</Resource><RequestId>{request_id}</RequestId>"
            "</Error>"
        ).encode()
        h.send_response_only(status)
        h.send_header("Content-Type", "application/xml")
        h.send_header("x-amz-request-id", request_id)
        h.send_header("Date", h.date_time_string())
        if h.command == "HEAD":
            h.send_header("Content-Length", "0")
            h.end_headers()
        else:
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        h.wfile.flush()


def _uploads_page(data: bytes, path: str, page: int) -> bytes:
    """One page of a ``ListMultipartUploads`` answer that lists every upload: the
    uploads after the request's markers, at most ``min(max-uploads, page)`` of them."""
    import xml.etree.ElementTree as ET

    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query, keep_blank_values=True)
    key_marker = query.get("key-marker", [""])[0]
    id_marker = query.get("upload-id-marker", [""])[0]
    limit = min(page, int(query.get("max-uploads", ["1000"])[0]))
    root = ET.fromstring(data)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    if ns:
        ET.register_namespace("", ns[1:-1])

    def text(el: Any, name: str) -> str:
        child = el.find(ns + name)
        return "" if child is None or child.text is None else child.text

    uploads = sorted(
        root.findall(ns + "Upload"), key=lambda u: (text(u, "Key"), text(u, "UploadId"))
    )
    if key_marker:
        uploads = [
            u
            for u in uploads
            if text(u, "Key") > key_marker
            or (id_marker and text(u, "Key") == key_marker and text(u, "UploadId") > id_marker)
        ]
    for el in list(root):
        if el.tag in {
            ns + n
            for n in ("Upload", "IsTruncated", "MaxUploads", "NextKeyMarker", "NextUploadIdMarker")
        }:
            root.remove(el)
    shown, truncated = uploads[:limit], len(uploads) > limit
    for name, value in (("MaxUploads", str(limit)), ("IsTruncated", str(truncated).lower())):
        ET.SubElement(root, ns + name).text = value
    if truncated:
        ET.SubElement(root, ns + "NextKeyMarker").text = text(shown[-1], "Key")
        ET.SubElement(root, ns + "NextUploadIdMarker").text = text(shown[-1], "UploadId")
    root.extend(shown)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def _without(headers: Any, name: str) -> Any:
    """A copy of the request's header message without ``name``."""
    import email.message

    out = email.message.Message()
    for k, v in headers.items():
        if k.lower() != name:
            out[k] = v
    return out


def wait_for(event: threading.Event, timeout_s: float, what: str) -> None:
    """Waits (bounded) for a rule's event; raises TimeoutError naming ``what``."""
    if not event.wait(timeout_s):
        raise TimeoutError(f"the proxy did not see {what} within {timeout_s:g} s")
