"""A local S3 protocol server for benchmarks: moto's, in its own process, on 127.0.0.1 only.

    with s3_server() as s3:               # s3.options: fsspec storage_options for it
        url = s3.upload(cache_dir, "s3://bench/cache")

A separate process, so serving the objects does not compete with the loader for the GIL. Its
throughput is moto's (a Python server), not a real object store's: remote / local ratios measured
against it are a floor for the loader's own overhead, not a forecast for S3.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Server:
    def __init__(self, port: int):
        self.endpoint = f"http://127.0.0.1:{port}"
        self.options = {"client_kwargs": {"endpoint_url": self.endpoint}, "key": "testing",
                        "secret": "testing", "skip_instance_cache": True}
        import s3fs
        self.fs = s3fs.S3FileSystem(**self.options)

    def upload(self, local: Path, url: str) -> str:
        path = url[len("s3://"):]
        bucket = path.split("/")[0]
        if not self.fs.exists(bucket):
            self.fs.mkdir(bucket)
        for p in sorted(Path(local).rglob("*")):
            if p.is_file():
                self.fs.put_file(str(p), f"{path}/{p.relative_to(local).as_posix()}")
        return url


@contextlib.contextmanager
def s3_server(timeout: float = 30.0):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, **CREDS)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    old = {k: os.environ.get(k) for k in CREDS}
    os.environ.update(CREDS)
    try:
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError("moto's S3 server did not start (pip install 'moto[server]')")
                time.sleep(0.1)
        yield Server(port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
