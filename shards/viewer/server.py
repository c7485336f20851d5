"""The viewer over HTTP: the standard library's ``ThreadingHTTPServer`` in front of :class:`~.app.App`.

One thread per request (a sample page's media arrive in parallel); the handler only copies the
request line and headers to :meth:`App.respond` and writes its :class:`~.app.Response` back. Every
response, the standard library's own error pages included, carries :data:`~.guard.SECURITY_HEADERS`
(added in ``end_headers``). A ``HEAD`` gets the headers alone.

While a request runs, :class:`ClientWatch` can tell whether its client is still there (the socket
reads end-of-file once the browser gave up or moved on): a filter condition asked for by a client
that left is stopped (:func:`shards.commands.query.matching_rows`), so a page nobody waits for pins
no core.
"""
from __future__ import annotations

import select
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable

from .app import App, Response
from .guard import SECURITY_HEADERS, allowed_names, is_loopback

#: how often a watched connection is looked at while its request runs (seconds)
WATCH_S = 0.1


class ClientWatch:
    """Whether the client of one connection went away while its request runs.

    :meth:`gone` starts (once) a thread that looks at the socket every :data:`WATCH_S` seconds and
    returns the event it sets when the peer closed its end (``recv(MSG_PEEK)`` reads end-of-file, or
    the connection was reset); :meth:`stop` ends that thread. A connection that sends more bytes
    (a pipelined request) is not watched further."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._event: threading.Event | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def gone(self) -> threading.Event:
        if self._event is None:
            self._event = threading.Event()
            self._thread = threading.Thread(target=self._watch, name="shardcache-view-client", daemon=True)
            self._thread.start()
        return self._event

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], WATCH_S)
                if not readable:
                    continue
                if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self._event.set()
                return  # end-of-file, or a next request already arriving: either way, done watching
            except BlockingIOError:
                continue
            except (OSError, ValueError):  # reset, or closed under us
                self._event.set()
                return

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def _handler(app: App) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "shardcache-view"
        sys_version = ""
        protocol_version = "HTTP/1.1"

        def end_headers(self) -> None:  # every response, send_error's included
            for k, v in SECURITY_HEADERS.items():
                self.send_header(k, v)
            super().end_headers()

        def _answer(self, method: str) -> None:
            watch = ClientWatch(self.connection)
            try:
                r = app.respond(method, self.path, dict(self.headers.items()), gone=watch.gone)
            except Exception as e:  # noqa: BLE001 - a bug is a 500 that names it, never a dropped connection
                traceback.print_exc(file=sys.stderr)
                r = Response(500, f"500 Internal Error: {type(e).__name__}: {e}\n".encode(), "text/plain; charset=utf-8")
            finally:
                watch.stop()
            if method not in ("GET", "HEAD"):  # its body is never read: this connection ends here
                self.close_connection = True
                r.headers.setdefault("Connection", "close")
            self.send_response(r.status)
            self.send_header("Content-Type", r.content_type)
            self.send_header("Content-Length", str(len(r.body)))
            for k, v in r.headers.items():
                self.send_header(k, v)
            self.end_headers()
            if method != "HEAD":
                try:
                    self.wfile.write(r.body)
                except (BrokenPipeError, ConnectionResetError):  # the client left meanwhile
                    self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer("HEAD")

        def _refuse(self) -> None:
            self._answer(self.command)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # 405: nothing is ever written

        def log_message(self, format: str, *args) -> None:  # one line per request on stderr, quietly
            if self.server.quiet:
                return
            sys.stderr.write(f"view: {self.address_string()} {format % args}\n")

    return Handler


class ViewerServer(ThreadingHTTPServer):
    """The HTTP server of one :class:`App` on ``(host, port)`` (port 0: a free one). ``url`` is its
    address; ``quiet`` silences the request log; ``allow_hosts`` are more ``Host`` names to answer
    (a proxy's, a DNS name of this machine), beside those of :func:`~.guard.allowed_names`, which
    the app is given. Raises ``OSError`` when the address is taken."""

    daemon_threads = True

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 0, quiet: bool = False,
                 allow_hosts: Iterable[str] = ()):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _handler(app))
        self.app, self.quiet = app, quiet
        name = f"[{host}]" if ":" in host else host
        self.url = f"http://{name}:{self.server_address[1]}/"
        app.allowed_hosts = allowed_names(host, str(self.server_address[0]), allow_hosts)

    def handle_error(self, request, client_address) -> None:
        """A client that reset or closed its connection is no error of the viewer's (said in one line
        unless ``quiet``); anything else is reported as the standard library does."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError, TimeoutError)):
            if not self.quiet:
                sys.stderr.write(f"view: {client_address[0]} closed the connection ({type(exc).__name__})\n")
            return
        super().handle_error(request, client_address)

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (tests); returns it. :meth:`shutdown` stops it."""
        t = threading.Thread(target=self.serve_forever, name="shardcache-view", daemon=True)
        t.start()
        return t


__all__ = ["ViewerServer", "ClientWatch", "is_loopback"]
