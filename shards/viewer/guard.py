"""What the viewer answers, and to whom: the browser it runs in is the threat model.

Any web page the user opens can make the browser request the viewer's URLs (an ``<img>``, an
``<audio>``, a ``fetch``, a top-level navigation), and a page on a domain that re-binds to 127.0.0.1
(DNS rebinding) even becomes same-origin with it. So every request passes :func:`refusal` before it
is routed, and every response carries :data:`SECURITY_HEADERS`:

* **Host**: the name in the ``Host`` header must be one of the viewer's own (:func:`allowed_names`:
  the address it was started with and the one it bound, ``localhost``, ``127.0.0.1``, ``::1``; for a
  wildcard address the machine's own names and addresses; ``--allow_host`` adds more). This is what
  stops DNS rebinding: a rebound page sends its own domain as ``Host``. The port is not compared,
  so an SSH tunnel from another local port (``ssh -L 9000:localhost:8000``) still works.
* **Sec-Fetch-Site** (sent by every current browser, not settable by a page): only ``same-origin``
  (the viewer's own pages) and ``none`` (an address typed or bookmarked by the user) are served.
  ``same-site`` (another port of 127.0.0.1: a notebook, a dev server) and ``cross-site`` are refused,
  so another origin's image, media or script load gets a 403 that says nothing about the cache (a
  key that exists and one that does not look the same).
* **Origin**, where the browser sends one (CORS requests, form posts), must be the viewer's own:
  ``http://`` and the request's ``Host``.
* The headers: ``Cross-Origin-Resource-Policy: same-origin`` (a browser without ``Sec-Fetch-*`` still
  refuses another origin's ``<img>``/``<audio>`` the bytes), a Content-Security-Policy that allows no
  script at all and media only from the viewer, ``frame-ancestors 'none'`` and ``X-Frame-Options:
  DENY`` (no framing: no clickjacking), ``Cross-Origin-Opener-Policy``, ``nosniff``, ``no-referrer``,
  ``no-store``. No ``Access-Control-Allow-*`` header is ever sent, so no other origin's script reads a
  response even where a request gets through.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Iterable, Mapping

#: sent with every response (error pages and the standard library's own errors included)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; media-src 'self'; "
                               "form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: the ``Sec-Fetch-Site`` values served: the viewer's own pages, and what the user opened directly
SERVED_FETCH_SITES = ("same-origin", "none")
#: names of this machine on its loopback interface
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: bind addresses that listen on every interface
WILDCARDS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, as ``--host`` takes it) is this machine only:
    ``localhost``, 127.0.0.0/8 (``127.1`` too: what ``inet_aton`` accepts) or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.inet_aton(host)).is_loopback  # 127.1, 0x7f.1 ...
    except (OSError, ValueError):
        return False


def _machine_names() -> set[str]:
    """This machine's host name, fully qualified name and the addresses they resolve to (offline:
    ``/etc/hosts`` and the resolver's cache; a failure just adds nothing)."""
    names = {socket.gethostname(), socket.getfqdn()}
    for n in list(names):
        try:
            names |= {str(ai[4][0]) for ai in socket.getaddrinfo(n, None)}
        except OSError:
            pass
    return {n for n in names if n}


def allowed_names(host: str, bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` names the viewer answers (lower case, IPv6 without brackets): ``host`` as given to
    ``--host``, the address it bound (``bound``), the loopback names, ``extra`` (``--allow_host``) and,
    for a wildcard address (``0.0.0.0``, ``::``), this machine's own names and addresses."""
    names = {host, bound, *LOOPBACK_NAMES, *extra}
    if host in WILDCARDS or bound in WILDCARDS:
        names |= _machine_names()
    return frozenset(n.strip("[]").lower() for n in names if n and n not in WILDCARDS)


def host_name(value: str) -> str:
    """The name of a ``Host`` header value (``"127.0.0.1:8000"`` -> ``"127.0.0.1"``, ``"[::1]:80"``
    -> ``"::1"``), lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def refusal(headers: Mapping[str, str], names: frozenset[str] | None) -> str | None:
    """Why a request with ``headers`` (names in lower case) is refused (403), or None to serve it
    (see the module docstring). ``names``: :func:`allowed_names`; None: not served over a socket
    (an :class:`~.app.App` called directly), no ``Host`` to check."""
    host = headers.get("host")
    if names is not None and (host is None or host_name(host) not in names):
        return f"Host {host!r} is not one of this viewer's names (a page reaching it through another name is refused)"
    site = headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in SERVED_FETCH_SITES:
        return (f"this request came from another site (Sec-Fetch-Site: {site}): the viewer answers its own pages "
                "and addresses you open yourself")
    origin = headers.get("origin")
    if origin is not None and origin.strip().lower().rstrip("/") != "http://" + (host or "").strip().lower():
        return f"this request came from another origin (Origin: {origin})"
    return None


__all__ = ["SECURITY_HEADERS", "SERVED_FETCH_SITES", "allowed_names", "host_name", "is_loopback", "refusal"]
