"""A cache stage one started and did not finish, and the one way forward: the same ``shardcache precompute``.

Stage one records its job in ``parts/job.json`` when it starts a cache and commits chunk after chunk
(``parts/*.index.parquet``); only when every chunk is committed does it merge them into ``index.parquet`` and
``manifest.json``. A folder holding the first and not the others is a job that stopped (killed, out of
memory, a node lost): the rows it had not encoded yet are nowhere but in its manifest. Rebuilding an index
from the committed tars (``shards reindex``) would publish a cache without them that then passes ``verify``;
the same precompute command run again keeps the committed chunks and encodes the rest. Every command that
finds such a folder says so (:func:`unfinished`), and ``shards reindex`` refuses it unless told to publish
the committed chunks alone (``--partial``), saying what is left out.

A **rerun** that stopped is the same story one step later. A rerun that changes chunks (rows edited or removed:
:mod:`precompute.rerun`) first removes ``integrity.json`` (until its merge, readers are told to wait or rerun),
then drops the stale chunks and encodes them again; ``index.parquet`` and ``manifest.json`` still describe the
cache before the rerun. Killed in between, the folder holds fewer (or other) committed chunks than that index
lists: rebuilding the index from the tars (``shards reindex``) would publish a cache without the rows of every
chunk the rerun had dropped and not encoded again yet. :func:`unfinished` says that too, with how many samples
reindex would leave out, and ``shards reindex`` refuses it as it refuses a killed first job.
"""
from __future__ import annotations

from pathlib import Path

import json

from .index import _JOB_PART as JOB_PART  # (stage one's record of its job: precompute.identity.JOB_FILE)
from .index import read_part_shard_entry
from .schema import INDEX_FILE, MANIFEST_FILE, PARTS_DIR, ROOT_FILE


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
    """What to say about ``d`` when stage one started it (or a rerun of it) and never finished (see the module
    docstring): what is there, the way forward (the same precompute command), and what ``shards reindex`` would
    leave out. None for any other folder."""
    d = Path(d)
    if not (d / PARTS_DIR / JOB_PART).is_file():
        return None
    if (d / MANIFEST_FILE).exists() or (d / INDEX_FILE).exists():
        return unfinished_rerun(d)
    chunks, samples = committed_chunks(d)
    return (f"{d}: stage one started this cache and has not finished it ({chunks} chunk(s) committed, holding "
            f"{samples} sample(s); no {INDEX_FILE} or {MANIFEST_FILE} yet): run the same `shardcache precompute` "
            "command again (same manifest, config and --cache) to complete it: it keeps the committed chunks and "
            f"encodes only the rest. `shardcache shards reindex {d}` would publish those {samples} sample(s) alone, "
            "leaving out every row the job had not encoded yet")


def _published(d: Path) -> dict[str, tuple[str | None, int]] | None:
    """The shards ``manifest.json`` lists: name -> ``(sha256, samples)`` (None when it cannot be read)."""
    try:
        shards = json.loads((d / MANIFEST_FILE).read_text()).get("shards")
        return {s["path"]: (s.get("sha256"), int(s.get("samples") or 0)) for s in shards}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _committed(d: Path) -> dict[str, tuple[str | None, int]]:
    """The shards the committed chunks hold: name -> ``(sha256, samples)`` (a chunk without a tar: none)."""
    out = {}
    for part in sorted((d / PARTS_DIR).glob("*.index.parquet")):
        try:
            entry = read_part_shard_entry(part)
        except (OSError, ValueError):
            continue
        if entry is not None:
            out[entry["path"]] = (entry.get("sha256"), int(entry.get("samples") or 0))
    return out


def unfinished_rerun(d: Path) -> str | None:
    """What to say about ``d`` when a rerun of stage one stopped after it began changing chunks (the module
    docstring): ``integrity.json`` gone, and the shards of the committed chunks other than those ``manifest.json``
    lists. Counts what ``shards reindex`` would leave out: the samples of every listed shard no chunk holds now.
    None for any other folder (a cache whose committed chunks are the published ones loses nothing by a reindex),
    and while a command writes the cache (a rerun under way: :func:`shards.writing.writer_of` names it)."""
    from .writing import writer_of
    d = Path(d)
    if (d / ROOT_FILE).exists() or not (d / PARTS_DIR / JOB_PART).is_file() or writer_of(d) is not None:
        return None
    published = _published(d)
    if published is None:
        return None
    now = _committed(d)
    if now == published:
        return None
    gone = {name: n for name, (_, n) in published.items() if name not in now}
    redone = [name for name in published if name in now and now[name] != published[name]]
    samples = sum(n for _, n in now.values())
    return (f"{d}: a rerun of stage one stopped before it finished this cache ({ROOT_FILE} removed as it began "
            f"changing chunks; {INDEX_FILE} and {MANIFEST_FILE} still describe the cache before it: of its "
            f"{len(published)} shard(s), {len(gone)} dropped to be encoded again and not written yet, "
            f"{len(redone)} written again; {len(now)} shard(s) committed now, holding {samples} sample(s)): run the "
            "same `shardcache precompute` command again (same manifest, config and --cache) to complete it: it "
            f"keeps the committed chunks and encodes only the rest. `shardcache shards reindex {d}` would publish "
            f"those {samples} sample(s) alone, leaving out the {sum(gone.values())} sample(s) of the {len(gone)} "
            "dropped shard(s) and every row the rerun had not encoded yet")


__all__ = ["unfinished", "unfinished_rerun", "committed_chunks"]
