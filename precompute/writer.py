"""The shard writer of a stage-one job, in a process of its own: the tar, npz and hashing work of
committing chunks never takes the main process's GIL (which the encoder thread needs the moment a
device call returns, and the main thread for everything else).

The main thread hands each encoded row (in manifest order) to :meth:`ChunkWriter.put`; a sender
thread writes it to a pipe as one JSON header (key, reject, json member, each array's member name,
dtype and shape) followed by each array's raw bytes (``Connection.send_bytes`` of the array's
buffer: no pickle, and the system calls release the GIL). The writer process rebuilds the row and
gives it to :class:`shards.writer.ShardWriter`, committing each chunk when its last row arrived (its
index part records the chunk's row ids and digests: :mod:`precompute.rerun`); it tells the parent
each commit, and a listener thread there uploads the chunk (a remote cache's
:meth:`precompute.output.RemoteOutput.chunk_committed`), counts it and updates the progress bar.

``process=False`` runs the same loop in a thread of this process (the pipe between them then only
carries the rows to it): what a job on the CPU does (:func:`precompute.job.writer_process`).
A writer that fails reports the error; the next :meth:`ChunkWriter.put` raises it. A writer process that
dies (killed, out of memory) is an infrastructure fault (:class:`precompute.faults.ProcessDied`, naming its pid
and the signal): ``put``/``close`` raise it, and :meth:`ChunkWriter.close` removes the temporary files of the
chunk it was writing (committed chunks stay; a rerun writes the rest). A writer that **hangs** is handled the same
way: with a stall deadline (``stall_s``, the job's ``stall_timeout_s``), a writer that takes no row and sends no
commit for that long while the main thread waits for it (``put`` with the queue full, ``close``) is killed
(``SIGKILL``) and ``put``/``close`` raise its :class:`precompute.faults.ProcessHung`; a writer thread cannot be
killed: the job stops around it. An upload of a committed chunk (a remote cache) is the store's progress, not a
hang (the store has its own retries).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from .faults import InfrastructureFault, ProcessDied, ProcessHung, kill, kind_of, poll_every, rebuild
from .rerun import RowRecord, chunk_meta

#: rows queued for the sender thread at most (back-pressure on the main thread beyond)
QUEUE_ROWS = 64


def _encode_row(key: str, fields: dict | None, reject: tuple | None) -> tuple[bytes, list[np.ndarray]]:
    arrays, meta = [], []
    head: dict[str, Any] = {"op": "row", "key": key, "reject": list(reject) if reject else None}
    if fields is not None:
        head["json"] = fields.get("json")
        for name, value in fields.items():
            if name == "json":
                continue
            a = np.ascontiguousarray(value)
            meta.append([name, a.dtype.str, list(a.shape)])
            arrays.append(a)
        head["arrays"] = meta
    return json.dumps(head).encode(), arrays


def _decode_row(conn, head: dict) -> tuple[str, dict | None, tuple | None]:
    if head["reject"] is not None:
        return head["key"], None, tuple(head["reject"])
    fields: dict[str, Any] = {"json": head["json"]}
    for name, dtype, shape in head["arrays"]:
        buf = conn.recv_bytes()
        fields[name] = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
    return head["key"], fields, None


def _serve(conn, out_dir: str, chunks: list[tuple[str, list[RowRecord]]], parent: int | None) -> None:
    """The writer's loop (in the writer process, or a thread): rows from ``conn``, commits to ``conn``."""
    from shards.writer import ShardWriter
    if parent is not None:
        from .lock import die_with_parent
        die_with_parent(parent)
    writer = None
    try:
        for name, records in chunks:
            writer = ShardWriter(Path(out_dir), name)
            for _ in records:
                head = json.loads(conn.recv_bytes())
                if head["op"] == "abort":
                    writer.abort()
                    conn.send_bytes(json.dumps({"op": "aborted"}).encode())
                    return
                key, fields, reject = _decode_row(conn, head)
                if reject:
                    writer.reject(*reject)
                else:
                    writer.add(key, fields)
            entry = writer.commit(chunk_meta(records, writer.keys))  # the rows it covered: reruns
            writer = None
            conn.send_bytes(json.dumps({"op": "committed", "name": name, "tar": entry is not None}).encode())
        head = json.loads(conn.recv_bytes())  # the end (or an abort after the last chunk)
        conn.send_bytes(json.dumps({"op": "done"}).encode())
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        if writer is not None:
            writer.abort()
        try:
            from shards.errors import ShardcacheError
            conn.send_bytes(json.dumps({"op": "error", "message": f"{type(e).__name__}: {e}",
                                        "refused": type(e).__name__ if isinstance(e, ShardcacheError) else None,
                                        "fault": kind_of(e), "text": str(e),
                                        "traceback": traceback.format_exc()}).encode())
        except OSError:
            pass
    finally:
        conn.close()  # the sender's writes fail instead of blocking on a pipe nobody reads


def _refusal(name: str | None, text: str) -> Exception | None:
    """The :class:`shards.errors.ShardcacheError` subclass ``name`` the writer raised, rebuilt with its text."""
    if name is None:
        return None
    from shards import errors
    cls = {c.__name__: c for c in vars(errors).values()
           if isinstance(c, type) and issubclass(c, errors.ShardcacheError)}.get(name, errors.ShardcacheError)
    try:
        return cls(text)
    except TypeError:  # a refusal built from more than a message
        return errors.ShardcacheError(text)


class ChunkWriter:
    """Commits a job's chunks from encoded rows (see the module docstring).

    Args:
        output: the job's :class:`precompute.output.LocalOutput` (its ``local`` folder is written;
            :meth:`~precompute.output.LocalOutput.chunk_committed` is called here, in this process).
        chunks: ``[(shard name, its rows' records)]`` (:class:`precompute.rerun.RowRecord`) in the order
            the rows will come; each commit records them (:func:`precompute.rerun.chunk_meta`).
        summary: counts ``shards_written``; ``progress``: a tqdm bar (or None).
        process: write in a forked process (default) or a thread of this process.
        stall_s: the stall deadline (seconds; None: none), see the module docstring.
    """

    def __init__(self, output: Any, chunks: list[tuple[str, list[RowRecord]]], summary: Any,
                 progress: Any = None, process: bool = True, stall_s: float | None = None):
        self.output, self.summary, self.progress = output, summary, progress
        self.stall_s = stall_s
        self._progress_t = time.monotonic()  # the writer's last progress: a row taken or sent, a message
        self._uploading = False
        self.error: str | None = None
        #: the writer's own refusal (a :class:`shards.errors.ShardcacheError`, e.g. a symlinked ``.tmp``),
        #: rebuilt here: put/close raise it as it is, like any refusal of the job (else a RuntimeError)
        self.refusal: Exception | None = None
        #: the writer's infrastructure fault (:mod:`precompute.faults`: its process died, the disk is full)
        self.fault: InfrastructureFault | None = None
        self._names = [name for name, _ in chunks]
        self._committed: set[str] = set()
        self._rows: queue.Queue = queue.Queue(maxsize=QUEUE_ROWS)
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=True)
        args = (child, str(output.local), chunks, os.getpid() if process else None)
        self._worker = ctx.Process(target=_serve, args=args, daemon=True, name="shard-writer") if process else \
            threading.Thread(target=_serve, args=args, daemon=True, name="shard-writer")
        self._worker.start()
        if process:
            child.close()
        self._child = child
        self._sender = threading.Thread(target=self._send, daemon=True, name="shard-writer-send")
        self._listener = threading.Thread(target=self._listen, daemon=True, name="shard-writer-listen")
        self._done = threading.Event()
        self._sender.start()
        self._listener.start()

    def _beat(self) -> None:
        self._progress_t = time.monotonic()

    def _send(self) -> None:
        while True:
            item = self._rows.get()
            self._beat()
            try:
                if item is None:
                    self._conn.send_bytes(json.dumps({"op": "end"}).encode())
                    return
                if item == "abort":
                    self._conn.send_bytes(json.dumps({"op": "abort"}).encode())
                    return
                head, arrays = _encode_row(*item)
                self._conn.send_bytes(head)
                for a in arrays:
                    self._conn.send_bytes(memoryview(a).cast("B") if a.size else b"")
                self._beat()
            except OSError as e:  # the writer is gone (it reported why, or died)
                self.error = self.error or f"shard writer gone: {e}"
                while item not in (None, "abort"):  # unblock the main thread, up to its last word
                    item = self._rows.get()
                return

    def _listen(self) -> None:
        try:
            while True:
                msg = json.loads(self._conn.recv_bytes())
                self._beat()
                if msg["op"] == "committed":
                    self._committed.add(msg["name"])
                    self._uploading = True
                    try:
                        self.output.chunk_committed(msg["name"], msg["tar"])  # a remote cache: upload it
                    finally:
                        self._uploading = False
                        self._beat()
                    self.summary.shards_written += msg["tar"]
                    if self.progress is not None:
                        self.progress.set_postfix(shards=self.summary.shards_written, rejected=self.summary.rejected)
                elif msg["op"] == "error":
                    self.error = msg["message"] + "\n" + msg["traceback"]
                    self.refusal = _refusal(msg["refused"], msg["text"])
                    if msg.get("fault"):
                        self.fault = rebuild(msg["fault"], "shard writer", f"shard writer: {msg['message']}")
                    return
                else:  # done, aborted
                    return
        except (EOFError, OSError) as e:
            if isinstance(self._worker, threading.Thread):
                self.error = self.error or f"the shard writer thread's pipe closed ({type(e).__name__}: {e})"
            else:
                self._worker.join(timeout=10)  # its exit code: the signal that killed it
                self.fault = (self.fault if isinstance(self.fault, ProcessHung) else None) or \
                    ProcessDied("shard writer process", self._worker.pid, self._worker.exitcode,
                                "the chunk it was writing is dropped; committed chunks are kept")
                self.error = self.error or str(self.fault)
        except BaseException as e:  # noqa: BLE001 - an upload failed: surfaced by put/close
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        finally:
            self._done.set()

    def _raise(self) -> None:
        if self.refusal is not None:
            raise self.refusal
        if self.fault is not None:
            raise self.fault
        raise RuntimeError(f"shard writer failed: {self.error}")

    def put(self, key: str, fields: dict | None, reject: tuple | None) -> None:
        """Hand one row (in manifest order) to the writer; blocks while ``QUEUE_ROWS`` rows wait. Raises
        the writer's refusal (a ``ShardcacheError``) or ``RuntimeError`` when it failed, its
        :class:`~precompute.faults.ProcessHung` when it hung."""
        if self.error is not None:
            self._raise()
        self._wait(lambda: self._offer((key, fields, reject)), "took no row")
        if self.error is not None:
            self._raise()

    def _poll_s(self) -> float | None:
        return poll_every(self.stall_s) if self.stall_s else None

    def _offer(self, item: Any) -> bool:
        try:
            self._rows.put(item, timeout=self._poll_s())
            return True
        except queue.Full:
            return False

    def _sent_all(self) -> bool:
        self._sender.join(self._poll_s())
        return not self._sender.is_alive()

    def _wait(self, ready: Any, doing: str) -> bool:
        """Call ``ready()`` (which waits up to :meth:`_poll_s`) until it is true. Past the stall deadline without
        progress the writer hung (``doing``: what it did not do): a process is killed (its death unblocks the
        sender and the listener, so this waits on), a thread is left where it is and this returns False."""
        while not ready():
            if isinstance(self.fault, ProcessHung) and not self.fault.killed:
                return False
            if self.stall_s is None or self.fault is not None or self._uploading or \
                    time.monotonic() - self._progress_t <= self.stall_s:
                continue
            if isinstance(self._worker, threading.Thread):
                self.fault = ProcessHung("shard writer thread", None, self.stall_s, doing, killed=False)
            else:
                self.fault = ProcessHung("shard writer process", self._worker.pid, self.stall_s, doing,
                                         detail="the chunk it was writing is dropped; committed chunks are kept")
                kill(self._worker.pid)
            self.error = self.error or str(self.fault)
        return True

    def close(self, abort: bool = False) -> None:
        """Wait until every chunk is committed (or, ``abort``, drop the unfinished one and stop). Raises
        the writer's refusal (a ``ShardcacheError``) or ``RuntimeError`` when it failed, its
        :class:`~precompute.faults.ProcessHung` when it hung (not with ``abort``: the job fails already). Interrupted
        meanwhile (``SIGTERM``: :class:`~precompute.faults.Stopped`), it still waits for the writer to end (the chunk
        it commits committed, or dropped) before the interruption goes on: no writer outlives the job."""
        try:
            self._end("abort" if abort else None)
        except BaseException:
            self._end("abort")
            raise
        if self.fault is not None:
            self._drop_leftovers()
        if self.error is not None and not abort:
            self._raise()

    def _end(self, item: str | None) -> None:
        """Hand the writer its last word (``None``: the end, ``"abort"``) and wait for it to end."""
        if self._wait(lambda: self._offer(item), "took no row") and self._wait(self._sent_all, "took no row") \
                and self._wait(lambda: self._done.wait(self._poll_s()), "committed nothing"):
            self._listener.join()
            self._worker.join(timeout=60)
            self._conn.close()

    def _drop_leftovers(self) -> None:
        """Remove what a writer that died (or failed on the store) left of the chunks it had not committed: its
        ``NAME.tar.tmp`` and the ``.tmp`` of their parts, and, where the chunk's index part (its commit marker) is
        not there, the ``NAME.tar`` and rejects part it had renamed into place before it was killed (in this job's
        writing session: no symlink followed)."""
        from shards.index import part_paths
        from shards.schema import PARTS_DIR
        from shards.writing import session
        local = Path(self.output.local)
        for name in self._names:
            if name in self._committed:
                continue
            stem = name[:-4]
            leftovers = [local / f"{name}.tmp"] + sorted((local / PARTS_DIR).glob(f"{stem}.*.tmp"))
            index, rejects = part_paths(local, stem)
            if not index.exists():  # (the parts are written last, the index part after the rejects part)
                leftovers += [local / name, rejects]
            for path in leftovers:
                if path.is_file() and not path.is_symlink():
                    with session(path) as s:
                        s.unlink(path)


__all__ = ["ChunkWriter", "QUEUE_ROWS"]
