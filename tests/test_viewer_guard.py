"""``shards view`` against the browser it runs in and against a condition that would run for hours, and
the writer rule of ``view``, ``query`` and ``stats`` (issue 49 item 6). Without a browser: raw HTTP to a
server started here on 127.0.0.1 (the browser half, another origin's page reading the viewer:
tests/test_viewer_browser.py)."""
from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pyarrow.parquet as pq
import pytest

pytest.importorskip("jinja2")
pytest.importorskip("duckdb")

from shards.viewer.app import App  # noqa: E402
from shards.viewer.data import ViewedCache  # noqa: E402
from shards.viewer.guard import allowed_names, host_name  # noqa: E402
from shards.viewer.server import ViewerServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: one SQL condition that would scan for days: a subquery over 10**15 generated rows
ENDLESS = "(SELECT count(*) FROM range(1000000000000000)) > 0"
TICK = os.sysconf("SC_CLK_TCK")


from viewer_caches import viewer_cache_dir  # noqa: F401,E402 (autouse: the viewer's cache folder per module)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    from test_loaders import make_cache
    return make_cache(tmp_path_factory.mktemp("guard"), (5, 4), image_every=3)


def keys_of(cache: Path) -> list[str]:
    return pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()


def get(host: str, port: int, path: str, headers: dict | None = None, method: str = "GET"):
    c = http.client.HTTPConnection(host, port, timeout=60)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


class Served:
    """``shards view CACHE --port 0 ARGS`` in a process of its own; ``pid``, ``host``, ``port``, and
    ``log``: the lines it wrote on stderr so far (one per request)."""

    def __init__(self, cache: Path, *args: str, cwd: Path = ROOT, prelude: str = "", env: dict | None = None):
        import threading
        code = (prelude + "\nimport sys\nfrom shardcache.cli import main\n"
                "sys.exit(main(['shards', 'view', sys.argv[1], '--port', '0', *sys.argv[2:]]))")
        self.p = subprocess.Popen([sys.executable, "-c", code, str(cache), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(iter(self.p.stderr.readline, "")), daemon=True).start()
        first = self.p.stdout.readline()
        line = self.p.stdout.readline().strip()
        if not line.startswith("http://"):
            self.p.kill()
            raise AssertionError(first + line + "".join(self.log))
        self.url = line.split()[0]
        self.host, port = self.url[len("http://"):-1].rsplit(":", 1)
        self.port, self.pid = int(port), self.p.pid

    def cpu_s(self) -> float:
        """User + system CPU seconds the process has used (``/proc/PID/stat``)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    def stop(self) -> None:
        self.p.terminate()
        self.p.wait(timeout=30)


# ------------------------------------------------------------------------------- who is answered

def test_the_host_header_must_name_the_viewer_even_for_127_1(cache):
    """``--host 127.1`` (not spelled as a loopback address) served any Host before: a rebound DNS name
    read it. Now only its own names are answered, on any port (an SSH tunnel from another port)."""
    srv = Served(cache, "--host", "127.1")
    try:
        assert srv.url.startswith("http://127.1:")
        for host in (f"127.1:{srv.port}", f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "localhost:9000"):
            status, _, body = get("127.0.0.1", srv.port, "/", {"Host": host})
            assert status == 200 and b'class="key"' in body, host
        for host in (f"evil.example:{srv.port}", f"127.0.0.1.evil.example:{srv.port}", "[::2]", ""):
            status, _, body = get("127.0.0.1", srv.port, "/", {"Host": host})
            assert status == 403, host
            assert not any(k.encode() in body for k in keys_of(cache)), host
    finally:
        srv.stop()


def test_the_names_a_wildcard_address_answers_are_this_machines_own():
    names = allowed_names("0.0.0.0", "0.0.0.0", ["proxy.internal"])
    assert {"localhost", "127.0.0.1", "::1", "proxy.internal", socket.gethostname().lower()} <= names
    assert "0.0.0.0" not in names and "evil.example" not in names
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost:80") == "localhost"


@pytest.fixture(scope="module")
def server(cache):
    srv = ViewerServer(App(ViewedCache(cache)), "127.0.0.1", 0, quiet=True)
    srv.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_request_of_another_site_or_origin_is_refused_and_learns_nothing(cache, server):
    port = server.server_address[1]
    key = keys_of(cache)[0]
    here = f"127.0.0.1:{port}"
    for path in ("/", f"/sample/{quote(key)}", f"/sample/{quote(key)}/audio/audio/0.wav", "/sample/nokey/thumb.png"):
        for site in ("cross-site", "same-site"):  # same-site: another port of 127.0.0.1
            status, headers, body = get("127.0.0.1", port, path, {"Host": here, "Sec-Fetch-Site": site})
            assert status == 403 and headers["Content-Type"].startswith("text/plain"), (path, site)
            assert key.encode() not in body and b"RIFF" not in body  # not even whether the key exists
        status, _, _ = get("127.0.0.1", port, path, {"Host": here, "Origin": "http://127.0.0.1:1"})
        assert status == 403, path
    for site in ("same-origin", "none"):  # the viewer's own pages; an address the user opened
        assert get("127.0.0.1", port, "/", {"Host": here, "Sec-Fetch-Site": site})[0] == 200
    assert get("127.0.0.1", port, "/", {"Host": here, "Origin": f"http://{here}"})[0] == 200


def test_every_response_says_what_a_browser_may_do_with_it(cache, server):
    """CORP, CSP (no script at all), no framing, no sniffing: on pages, media, errors, refusals and the
    standard library's own answer to a malformed request."""
    port = server.server_address[1]
    key = keys_of(cache)[0]
    answers = [get("127.0.0.1", port, p, h, m) for p, h, m in (
        ("/", {}, "GET"), (f"/sample/{quote(key)}/audio/audio/0.wav", {}, "GET"), ("/favicon.ico", {}, "GET"),
        ("/nothing", {}, "GET"), ("/", {"Sec-Fetch-Site": "cross-site"}, "GET"), ("/", {}, "POST"))]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # http.server's own error
        s.sendall(b"GET / HTTP/1.1\r\nX-Long: " + b"x" * 70000 + b"\r\n\r\n")
        raw = s.recv(65536).decode("latin-1")
    assert raw.startswith("HTTP/1.1 431"), raw[:200]
    assert [a[0] for a in answers] == [200, 200, 200, 404, 403, 405]
    assert answers[2][1]["Content-Type"] == "image/svg+xml" and answers[2][2].startswith(b"<svg")
    for headers in [a[1] for a in answers] + [dict(line.split(": ", 1) for line in raw.split("\r\n")[1:] if ": " in line)]:
        assert headers["Cross-Origin-Resource-Policy"] == "same-origin"
        csp = headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src" not in csp and "frame-ancestors 'none'" in csp
        assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff"
        assert not any(k.lower().startswith("access-control-") for k in headers)


# ---------------------------------------------------------------------------- conditions that run on

def cpu_over(srv: Served, seconds: float) -> float:
    a = srv.cpu_s()
    time.sleep(seconds)
    return srv.cpu_s() - a


def test_an_endless_filter_stops_at_its_deadline_and_the_server_idles(cache):
    srv = Served(cache, "--query_timeout", "1")
    try:
        t0 = time.monotonic()
        status, _, body = get("127.0.0.1", srv.port, "/?where=" + quote(ENDLESS))
        assert status == 400 and b"stopped after 1 s" in body, body[:2000]
        assert time.monotonic() - t0 < 30
        used = cpu_over(srv, 1.5)
        assert used < 0.3, f"{used:.2f} s of CPU in 1.5 s after the deadline: the condition still runs"
        assert get("127.0.0.1", srv.port, "/")[0] == 200
    finally:
        srv.stop()


def test_a_filter_whose_client_left_is_stopped(cache):
    """A deadline of an hour: the condition must end because its client closed the connection."""
    srv = Served(cache, "--query_timeout", "3600")
    try:
        assert get("127.0.0.1", srv.port, "/?where=" + quote("duration_s > 0"))[0] == 200  # DuckDB imported
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        s.sendall(f"GET /?where={quote(ENDLESS)} HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
        busy = cpu_over(srv, 1.5)
        assert busy > 0.3, f"the condition did not run ({busy:.2f} s CPU)"  # (so the next figure means something)
        s.close()
        deadline = time.monotonic() + 30  # the request ends (logged with 503: nobody to answer)
        while not any(quote(ENDLESS) in line and '" 503 ' in line for line in srv.log) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any('" 503 ' in line for line in srv.log), "".join(srv.log)
        used = cpu_over(srv, 1.5)
        assert used < min(0.3, busy / 3), f"{used:.2f} s of CPU in 1.5 s after the client left ({busy:.2f} s while " \
                                          "it was there): the condition still runs"
        assert get("127.0.0.1", srv.port, "/")[0] == 200
    finally:
        srv.stop()


# ------------------------------------------------------------------------- a cache being written

def test_query_view_and_stats_refuse_a_cache_being_written_naming_the_writer(cache, tmp_path, capsys):
    """Also a first write (no index yet): it is being written, not "not a shardcache cache"."""
    from shards.cli import main
    from shards.writing import CacheWriter

    new = tmp_path / "new"
    for folder, create in ((cache, False), (new, True)):
        with CacheWriter(folder, "precompute", create=create):
            for argv in (["query", str(folder), "--count"], ["view", str(folder), "--port", "0"],
                         ["stats", str(folder)]):
                assert main(argv) == 2, argv
                err = capsys.readouterr().err
                assert "being written right now by precompute" in err, (argv, err)
                assert "not a shardcache cache" not in err and "reindex" not in err
    assert main(["query", str(cache), "--count"]) == 0
    assert capsys.readouterr().out.strip() == str(len(keys_of(cache)))


def test_every_page_says_when_the_cache_is_being_written(cache):
    from shards.writing import CacheWriter
    app = App(ViewedCache(cache))
    key = keys_of(cache)[0]
    assert b"being written right now" not in app.respond("GET", "/", {}).body
    with CacheWriter(cache, "add-field"):
        for path in ("/", f"/sample/{key}", "/nothing"):
            body = app.respond("GET", path, {}).body.decode()
            assert "being written right now by add-field" in body, path
