"""A model folder laid out as the Hugging Face hub cache holds it, the way ``huggingface_hub`` writes it.

What ``from_pretrained("org/name")`` leaves in ``$HF_HUB_CACHE`` (``$HF_HOME/hub``), and what a real user's
first run reads (``huggingface_hub`` 2.x ``file_download.hf_hub_download``)::

    CACHEDIR.TAG                                       the cache-directory tag (``_create_cachedir_tag``)
    models--org--name/
      blobs/<etag>                                     each file's bytes, named by its etag, no suffix
      snapshots/<40-hex commit>/<path in the repo>     relative symlinks ../../blobs/<etag> (``_create_symlink``;
                                                       ../../../blobs/ one folder deeper: ``vae/...``)
      refs/main                                        the commit ``main`` points at (no newline)

The etag is what the hub's HEAD answers: for a file stored with git LFS the sha256 of its bytes
(``X-Linked-Etag``), for a plain git file its git blob sha1 (``huggingface_hub.utils.sha.git_hash``:
``sha1(b"blob <size>\\0" + bytes)``). Which files are LFS is the repository's ``.gitattributes``; a repo made on
the hub starts with the hub's default one (:data:`LFS_PATTERNS`), and files over 10 MiB always go through LFS.

:func:`put` lays a folder out (typically one a tiny model was ``save_pretrained`` into) as revision
``commit`` of ``repo_id`` (a second :func:`put` of other files makes a second revision: ``refs/main`` moved, or
another ref, or a commit reached by its hash only); :func:`offline` points ``huggingface_hub`` (and so
``transformers`` and ``diffusers``) at a cache with ``HF_HUB_OFFLINE=1``, as ``HF_HUB_CACHE`` or through
``HF_HOME`` (the cache at ``$HF_HOME/hub``), for this process and its children.
``tests/test_hub_checkpoints.py`` checks the layout against ``huggingface_hub``'s own ``scan_cache_dir``,
``try_to_load_from_cache``, ``hf_hub_download`` and ``snapshot_download``.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator

#: the hub's default ``.gitattributes`` (a new model repository's): the files stored with git LFS
LFS_PATTERNS = ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
                "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
                "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
                "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*")
#: files larger than this go through LFS whatever their name (the hub refuses larger plain git files)
LFS_SIZE = 10 * 1024 * 1024


def repo_folder(cache_dir: str | Path, repo_id: str) -> Path:
    """``cache_dir/models--org--name`` (``huggingface_hub.file_download.repo_folder_name``)."""
    from huggingface_hub.file_download import repo_folder_name
    return Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")


def is_lfs(path_in_repo: str, size: int) -> bool:
    """Whether the hub stores ``path_in_repo`` (``size`` bytes) with git LFS in a repo with the default
    ``.gitattributes``: a name matching :data:`LFS_PATTERNS` (by its basename, as git matches patterns
    without a slash) or more than :data:`LFS_SIZE` bytes."""
    name = path_in_repo.rsplit("/", 1)[-1]
    return size > LFS_SIZE or any(fnmatch.fnmatch(path_in_repo if "/" in p else name, p) for p in LFS_PATTERNS)


def etag(path_in_repo: str, data: bytes) -> str:
    """The name the blob of a file gets in the cache: the sha256 of an LFS file's bytes, else its git
    blob sha1 (:func:`is_lfs`)."""
    from huggingface_hub.utils.sha import git_hash
    return hashlib.sha256(data).hexdigest() if is_lfs(path_in_repo, len(data)) else git_hash(data)


def commit_of(files: dict[str, str], parent: str = "") -> str:
    """A 40-hex commit id for a tree ``{path in repo: etag}`` (deterministic; ``huggingface_hub`` needs 40 hex
    digits, not a real git commit object)."""
    h = hashlib.sha1(f"tree {parent}\0".encode())
    for p in sorted(files):
        h.update(f"{p}\0{files[p]}\0".encode())
    return h.hexdigest()


def put(folder: str | Path, repo_id: str, cache_dir: str | Path, *, revision: str | None = "main",
        commit: str | None = None, under: str = "", absent: Iterable[str] = ()) -> Path:
    """Lay every file under ``folder`` out as commit ``commit`` (default: :func:`commit_of` its tree) of
    ``repo_id`` in the hub cache ``cache_dir``, exactly as ``hf_hub_download`` leaves each after a download:
    the bytes in ``blobs/<etag>`` (kept when a blob of that name exists: blobs are shared across commits),
    ``snapshots/<commit>/<path>`` a relative symlink to it, ``refs/<revision>`` = the commit (None: no ref,
    a commit reached by hash only), ``CACHEDIR.TAG`` at the root. ``under``: a folder of the repo the files
    go into (``vae`` of a pipeline). ``absent``: paths in the repo that a first (online) run looked for and the
    hub answered 404, which ``hf_hub_download`` records as an empty ``.no_exist/<commit>/<path>``, so an offline
    run knows they are absent (a tokenizer's repo without ``config.json``, which ``AutoTokenizer`` asks for).
    Returns the snapshot folder ``snapshots/<commit>``.

    A second :func:`put` of another folder with the same ``revision`` moves the ref to the new commit (a
    new revision of the repo); the old snapshot stays, as in a real cache."""
    folder, cache_dir = Path(folder), Path(cache_dir)
    repo = repo_folder(cache_dir, repo_id)
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = "/".join(filter(None, (under.strip("/"), f.relative_to(folder).as_posix())))
        data = f.read_bytes()
        files[rel] = (etag(rel, data), data)
    commit = commit or commit_of({p: e for p, (e, _) in files.items()})
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for rel, (tag, data) in files.items():
        blob = repo / "blobs" / tag
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))   # _create_symlink: relative to the link's folder
    for rel in absent:   # _hf_hub_download_to_cache_dir: on EntryNotFoundError, touch .no_exist/<commit>/<path>
        marker = repo / ".no_exist" / commit / rel
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    if revision is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    tag = cache_dir / "CACHEDIR.TAG"
    if not tag.exists():
        from huggingface_hub._local_folder import CACHEDIR_TAG_CONTENT
        tag.write_text(CACHEDIR_TAG_CONTENT)
    return snapshot


def blob_of(snapshot: str | Path, path_in_repo: str) -> Path:
    """The blob a snapshot's file links to (for tests that damage or replace one)."""
    link = Path(snapshot) / path_in_repo
    return (link.parent / os.readlink(link)).resolve()


@contextlib.contextmanager
def offline(cache_dir: str | Path | None = None, *, home: str | Path | None = None) -> Iterator[Path]:
    """``HF_HUB_OFFLINE=1`` and a hub cache inside the block, restored after: ``cache_dir`` as ``HF_HUB_CACHE``,
    or ``home`` as ``HF_HOME`` (the cache at ``home/hub``, as ``huggingface_hub`` derives it: ``HF_HUB_CACHE``
    and ``HUGGINGFACE_HUB_CACHE`` are unset, so a child process derives it from ``HF_HOME`` too). Set in the
    environment (for child processes) and in ``huggingface_hub.constants`` (read at import by this process's
    ``huggingface_hub``, whose functions ``transformers`` and ``diffusers`` call). Yields the hub cache folder.
    Raises ``TypeError`` unless exactly one of ``cache_dir`` and ``home`` is given."""
    from huggingface_hub import constants
    if (cache_dir is None) == (home is None):
        raise TypeError("offline(): give the hub cache (cache_dir, HF_HUB_CACHE) or the Hugging Face home "
                        "(home=, HF_HOME), one of them")
    if home is not None:
        hub = Path(home) / "hub"     # huggingface_hub.constants: default_cache_path = HF_HOME/hub
        env = {"HF_HOME": str(home), "HF_HUB_CACHE": None, "HUGGINGFACE_HUB_CACHE": None, "HF_HUB_OFFLINE": "1"}
        patched = {"HF_HOME": str(home), "HF_HUB_CACHE": str(hub), "HUGGINGFACE_HUB_CACHE": str(hub),
                   "HF_HUB_OFFLINE": True}
    else:
        hub = Path(cache_dir)
        env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
        patched = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": True}
    old_env = {k: os.environ.get(k) for k in env}
    old = {k: getattr(constants, k) for k in patched}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in patched.items():
            setattr(constants, k, v)
        yield hub
    finally:
        for k, v in old.items():
            setattr(constants, k, v)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = ["LFS_PATTERNS", "LFS_SIZE", "blob_of", "commit_of", "etag", "is_lfs", "offline", "put", "repo_folder"]
