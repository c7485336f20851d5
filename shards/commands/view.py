"""``shards view``: a local web viewer of a cache (:mod:`shards.viewer`, docs/viewer.md)::

    shardcache shards view cache/demo                     # http://127.0.0.1:8000/
    shardcache shards view s3://bucket/caches/tts --port 8080
    shardcache shards view cache/demo --host 0.0.0.0      # other machines too (warns)

Serves on 127.0.0.1 unless ``--host`` names another address, prints the URL, and runs until
Ctrl-C. Needs the ``[inspect]`` extra (Jinja2, DuckDB, matplotlib, Pillow): without it the command
exits 2 saying so. It never goes online for the cache's tokenizer: ``HF_HUB_OFFLINE`` is set for the
whole process before anything of Hugging Face's is imported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ._common import Out, UsageError, cache_dir, warn
from .needs import VIEWER
from .query import VIEWER_DEADLINE_S

DEFAULT_PORT = 8000


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "view", help="browse a cache in a web browser: samples, tokens and labels, audio, images, rejects",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a local web viewer of a cache and print its URL. The index page shows the samples\n"
                    "as a grid (each one's text, a thumbnail and a player; sortable columns; a text search and\n"
                    "a filter taking the SQL condition of `shards query`; histograms of duration, tokens and\n"
                    "trained share), the rejects and the encoders and preprocessing the manifest records. A\n"
                    "sample's page shows its conversation one element per input_ids token with its label\n"
                    "(trained tokens marked), a player per cached audio item, the codes, the images as stage\n"
                    "one saw them, the latents channel by channel, the image features' norms and the sample's\n"
                    "JSON, with next/previous in the view it was opened from. Reads only (every sample through\n"
                    "shards.ShardReader, checksums checked), never goes online; requests of other sites and\n"
                    "other Host names are refused. Ctrl-C stops it.",
        epilog="examples:\n"
               "  shardcache shards view cache/demo\n"
               "  shardcache shards view cache/demo --port 0          (any free port)\n"
               "  shardcache shards view s3://bucket/caches/tts --storage_options "
               "'{\"client_kwargs\": {\"endpoint_url\": \"http://127.0.0.1:9000\"}}'\n"
               "  shardcache shards view cache/demo --host 0.0.0.0    (reachable from other machines: warns)")
    p.add_argument("dir", metavar="CACHE", help="cache directory, or a remote cache's URL (s3://..., any URL "
                                                "the loaders read)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                   help="TCP port to listen on (default: %(default)s; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1", metavar="H",
                   help="address to listen on (default: %(default)s, this machine only; another address "
                        "lets anyone who reaches it read the cache, and is warned about)")
    p.add_argument("--storage_options", type=_mapping, default=None, metavar="JSON",
                   help="with a URL: fsspec options as a JSON object, e.g. "
                        "'{\"client_kwargs\": {\"endpoint_url\": \"http://minio:9000\"}}'")
    p.add_argument("--allow_host", action="append", default=[], metavar="NAME",
                   help="one more Host name to answer (a proxy's, a DNS name of this machine); repeatable. "
                        "Requests naming any other host are refused (DNS rebinding)")
    p.add_argument("--query_timeout", type=float, default=VIEWER_DEADLINE_S, metavar="S",
                   help="seconds a filter condition may run before it is stopped (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    p.set_defaults(func=cmd_view, needs=VIEWER)


def _mapping(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def cmd_view(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: a TCP port is 0..65535 (0: any free port)")
    timeout = args.query_timeout
    if not timeout > 0:
        raise UsageError(f"--query_timeout {args.query_timeout}: seconds, more than 0")
    os.environ["HF_HUB_OFFLINE"] = "1"  # a page view never goes online (the tokenizer's files are local or absent)
    from ..storage import is_url, local_path
    from ..viewer.app import App
    from ..viewer.data import ViewedCache
    from ..viewer.server import ViewerServer, is_loopback
    from .query import refuse_while_written

    if not is_url(args.dir):
        try:
            where = local_path(args.dir)
        except ValueError as e:
            raise UsageError(str(e)) from None
        # before anything else: a first write has no index yet, and that is no reason to call it "not a cache"
        refuse_while_written(where, "not served (its index and shards are half-written)")
    source = args.dir if is_url(args.dir) else str(cache_dir(args.dir))
    if args.storage_options is not None and not is_url(args.dir):
        raise UsageError("--storage_options is for a remote cache (a URL such as s3://bucket/cache)")
    t0 = time.perf_counter()
    vc = ViewedCache(source, storage_options=args.storage_options, query_timeout_s=timeout)
    try:
        app = App(vc)
        try:
            server = ViewerServer(app, args.host, args.port, quiet=args.quiet, allow_hosts=args.allow_host)
        except OSError as e:
            raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; choose another "
                             "--port (0: any free port)") from None
        if not is_loopback(args.host):
            warn(f"serving on {args.host}, not 127.0.0.1: anyone who can reach this machine on port "
                 f"{server.server_address[1]} can read this cache's samples, transcripts and audio")
        out = Out(args)
        out.line(f"shardcache view: {len(vc):,} samples of {vc.source} (cache id {vc.id}, opened in "
                 f"{time.perf_counter() - t0:.2f} s)")
        out.line(f"  {server.url}   (Ctrl-C stops it)")
        sys.stdout.flush()
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            out.line("stopped")
        finally:
            server.server_close()
    finally:
        vc.close()
    return 0
