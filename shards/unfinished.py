"""A cache stage one started and did not finish, and the one way forward: the same ``shardcache precompute``.

Stage one records its job in ``parts/job.json`` when it starts a cache and commits chunk after chunk
(``parts/*.index.parquet``); only when every chunk is committed does it merge them into ``index.parquet`` and
``manifest.json``. A folder holding the first and not the others is a job that stopped (killed, out of
memory, a node lost): the rows it had not encoded yet are nowhere but in its manifest. Rebuilding an index
from the committed tars (``shards reindex``) would publish a cache without them that then passes ``verify``;
the same precompute command run again keeps the committed chunks and encodes the rest. Every command that
finds such a folder says so (:func:`unfinished`), and ``shards reindex`` refuses it unless told to publish
the committed chunks alone (``--partial``), saying what is left out.
"""
from __future__ import annotations

from pathlib import Path

from .index import _JOB_PART as JOB_PART  # (stage one's record of its job: precompute.identity.JOB_FILE)
from .schema import INDEX_FILE, MANIFEST_FILE, PARTS_DIR


def committed_chunks(d: Path) -> tuple[int, int]:
    """``(chunks, samples)`` committed in ``d/parts`` (index parts and their rows)."""
    import pyarrow.parquet as pq
    parts = sorted((Path(d) / PARTS_DIR).glob("*.index.parquet"))
    samples = 0
    for p in parts:
        try:
            samples += pq.read_metadata(p).num_rows
        except (OSError, ValueError):
            pass
    return len(parts), samples


def unfinished(d: Path) -> str | None:
    """What to say about ``d`` when stage one started it and never finished it (see the module docstring): what
    is there, the way forward (the same precompute command), and what ``shards reindex`` would leave out. None
    for any other folder."""
    d = Path(d)
    if not (d / PARTS_DIR / JOB_PART).is_file() or (d / MANIFEST_FILE).exists() or (d / INDEX_FILE).exists():
        return None
    chunks, samples = committed_chunks(d)
    return (f"{d}: stage one started this cache and has not finished it ({chunks} chunk(s) committed, holding "
            f"{samples} sample(s); no {INDEX_FILE} or {MANIFEST_FILE} yet): run the same `shardcache precompute` "
            "command again (same manifest, config and --cache) to complete it: it keeps the committed chunks and "
            f"encodes only the rest. `shardcache shards reindex {d}` would publish those {samples} sample(s) alone, "
            "leaving out every row the job had not encoded yet")


__all__ = ["unfinished", "committed_chunks"]
