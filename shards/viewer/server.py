"""The viewer over HTTP: the standard library's ``ThreadingHTTPServer`` in front of :class:`~.app.App`.

One thread per request (a sample page's media arrive in parallel); the handler only copies the
request line and headers to :meth:`App.respond` and writes its :class:`~.app.Response` back, with
the security headers of :data:`~.app.SECURITY_HEADERS`. A ``HEAD`` gets the headers alone.
"""
from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .app import SECURITY_HEADERS, App


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine only: ``localhost`` or 127.0.0.0/8, ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler(app: App) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "shardcache-view"
        sys_version = ""
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            r = app.respond(method, self.path, dict(self.headers.items()))
            if method not in ("GET", "HEAD"):  # its body is never read: this connection ends here
                self.close_connection = True
                r.headers.setdefault("Connection", "close")
            self.send_response(r.status)
            self.send_header("Content-Type", r.content_type)
            self.send_header("Content-Length", str(len(r.body)))
            for k, v in {**SECURITY_HEADERS, **r.headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(r.body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer("HEAD")

        def _refuse(self) -> None:
            self._answer(self.command)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # 405: nothing is ever written

        def log_message(self, format: str, *args) -> None:  # one line per request on stderr, quietly
            if getattr(self.server, "quiet", False):
                return
            sys.stderr.write(f"view: {self.address_string()} {format % args}\n")

    return Handler


class ViewerServer(ThreadingHTTPServer):
    """The HTTP server of one :class:`App` on ``(host, port)`` (port 0: a free one). ``url`` is its
    address; ``quiet`` silences the request log. Raises ``OSError`` when the address is taken."""

    daemon_threads = True

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 0, quiet: bool = False):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _handler(app))
        self.app, self.quiet = app, quiet
        name = f"[{host}]" if ":" in host else host
        self.url = f"http://{name}:{self.server_address[1]}/"
        if is_loopback(host):  # a page of another site reaching us through a rebound DNS name: 403
            port_ = self.server_address[1]
            app.allowed_hosts = {f"{h}:{port_}" for h in ("127.0.0.1", "localhost", name)}

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (tests); returns it. :meth:`shutdown` stops it."""
        t = threading.Thread(target=self.serve_forever, name="shardcache-view", daemon=True)
        t.start()
        return t


__all__ = ["ViewerServer", "is_loopback"]
