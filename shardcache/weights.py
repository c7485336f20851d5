"""The identity of an encoder's weights: the tensors of the files its loading library opens, the same at
stage one and in a recipe's contract.

**Which files.** ``transformers`` (the codecs, Gemma 3 and its vision tower, the LMs) and ``diffusers`` (the
VAEs) each decide which weight files of a checkpoint (a local folder or a hub id, a ``subfolder``, a
``revision``) ``from_pretrained`` opens, and they decide differently where a folder holds both one file and
a sharded index. :func:`loaded_files` follows that decision, with each library's own file names and its
own order (:func:`candidates`), reading hub ids through ``huggingface_hub``'s cache (``hf_hub_download``,
which honours ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE``):

==============  ===========================================================================================
transformers    ``config.json``'s ``transformers_weights`` when it names a file (that file alone), else
                ``model.safetensors``, then ``model.safetensors.index.json``, then ``pytorch_model.bin``, then
                its index (``modeling_utils._get_resolved_checkpoint_files``): a single file beside an index
                wins
diffusers       ``diffusion_pytorch_model.safetensors.index.json``, then ``diffusion_pytorch_model.safetensors``,
                then ``diffusion_pytorch_model.bin`` (``ModelMixin.from_pretrained``: ``_fetch_index_file``
                first); a local folder's single file is looked for at its root before its ``subfolder``
                (``_get_model_file``): the index wins
==============  ===========================================================================================

The names are the libraries' constants (``transformers.utils.SAFE_WEIGHTS_NAME``...,
``diffusers.utils.SAFETENSORS_WEIGHTS_NAME``...), imported where they are asked for; a training process
never imports ``diffusers`` (:data:`train.imports.FORBIDDEN_MODULES`), so it asks a child process
(:func:`loaded_files` ``isolated=True``; ``python -m shardcache.weights``), which prints the files.
``tests/test_hub_checkpoints.py`` checks, for single, sharded and both, in a folder and in the hub cache,
that these are the files each library opens.

**How they are read.** The reader of a file is chosen from the file's own first bytes (a safetensors
header, a zip or pickle torch file: :func:`file_format`), never from its suffix: a hub cache's blob has none,
nor has a file git-annex or DVC links to.

**The hash** (:func:`checkpoint_sha256`): for each selected tensor in name order its name, dtype, shape and
raw bytes, so the same tensors saved again (one file or shards, another folder, a hub id or its snapshot)
hash alike and one changed value does not. Why the files' tensors and not the loaded module's
``state_dict`` (the encoders' ``weights_sha256``): the loaded module depends on the dtype it was loaded
in, on the library (weight-norm parametrisations rename tensors) and needs the model class (the Higgs
audio tokenizer imports torchaudio); the files need none of them. About 1 s per 500 MB; no model is built.

**Which revision.** A hub id is read at ``revision`` (a branch, tag or 40-hex commit; default ``main``), the
one ``from_pretrained(..., revision=...)`` is given: ``hf_hub_download(..., revision=...)`` resolves it in the
hub cache (``refs/<branch or tag>`` -> ``snapshots/<commit>``, or the commit itself) as the library does. A
revision with a local folder is refused (:class:`LocalRevision`): the libraries ignore it there, so the
files loaded would not be the revision named.

**Where from** (:func:`identity`'s ``loaded_from``, :data:`SOURCE_KEY`): the hub id, the revision asked for
(``requested``) and the snapshot commit the files were read at (``revision``), or the absolute local folder,
and the files' names: recorded beside the hash for people, never compared (``precompute.encoders.fingerprint``
leaves it out of a cache's fingerprint): two revisions of the same files make the same cache.

Whatever cannot be read (a broken link, a corrupt or truncated file, an index that does not parse or
names a missing shard, a file of no known format) raises :class:`CheckpointUnreadable`, naming the file,
what it resolves to and why: stage one and ``shardcache train`` exit 2 on it before any weight loads.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from shards.errors import ShardcacheError

#: the libraries whose loading rules :func:`candidates` knows
LIBRARIES = ("transformers", "diffusers")
#: the tensors of Gemma 3's image path inside a ``Gemma3ForConditionalGeneration`` checkpoint (the SigLIP
#: vision tower and the multimodal projector): what stage one's ``image_features`` runs and what the
#: ``theworld`` recipe hashes from its checkpoint (``checkpoint_sha256(lm, select=under(*GEMMA3_VISION))``)
GEMMA3_VISION = ("vision_tower.", "multi_modal_projector.")
#: the key of an encoder's ``describe()`` that records where its weights were read (:func:`identity`): kept
#: for people, left out of every fingerprint (``precompute.encoders.fingerprint``), never compared
SOURCE_KEY = "loaded_from"
#: bytes a safetensors header may take (the format's own limit is 100 MB)
_MAX_HEADER = 100_000_000


class CheckpointUnreadable(ShardcacheError):
    """A checkpoint's identity cannot be read: the message names the file (as listed, and what it resolves
    to), and why (a broken link, a missing shard, a corrupt or truncated file, an index that does not parse,
    no weight file at all). Every command line exits 2 for it, before any weight loads."""

    exit_code = 2


class CheckpointMissing(CheckpointUnreadable):
    """A checkpoint that holds none of the weight files its library loads (a hub id offline: not in the
    hub cache; a ``revision`` the hub cache does not hold)."""


class LocalRevision(CheckpointUnreadable):
    """A ``revision`` given with a local folder. A folder has no revisions: ``transformers`` and ``diffusers``
    ignore ``revision`` for a local folder (``cached_file`` / ``_get_model_file`` read the folder's files
    whatever it says), so a run would load other files than the revision it names, and record a revision it
    never read. Refused instead, naming both: give the hub id (its revision is read through the hub cache),
    or leave ``revision`` unset."""


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint is: ``pretrained`` (a local folder, or a hub id read through the hub cache),
    ``subfolder`` (``vae`` of a diffusers pipeline) and ``revision`` (a hub branch, tag or commit; None:
    ``main``, what ``from_pretrained`` reads)."""

    pretrained: str
    subfolder: str | None = None
    revision: str | None = None

    @property
    def local(self) -> bool:
        """A local folder (``os.path.isdir``, as ``transformers`` and ``diffusers`` decide), else a hub id."""
        return os.path.isdir(self.pretrained)

    def __str__(self) -> str:
        where = self.pretrained if self.local or not self.revision else f"{self.pretrained}@{self.revision}"
        return f"{where} ({self.subfolder}/)" if self.subfolder else where

    def requested(self) -> dict[str, str]:
        """``{"requested": revision}`` for a hub id (the revision asked for, ``main`` by default); ``{}`` for a
        local folder, which has none."""
        return {} if self.local else {"requested": self.revision or "main"}

    def name(self, filename: str) -> str:
        """``filename`` as listed in the checkpoint (``vae/diffusion_pytorch_model.safetensors``)."""
        return f"{self.subfolder.strip('/')}/{filename}" if self.subfolder else filename

    def fetch(self, filename: str, *, at_root: bool = False) -> Path | None:
        """``filename`` in this checkpoint (in its ``subfolder``; ``at_root``: in the folder itself), as the
        folder or the hub cache holds it (a hub file is the snapshot's link, not its blob); None when there
        is none (a hub id offline: none in the cache). Raises :class:`CheckpointUnreadable` for a link
        whose target is gone, and for a hub error other than "no such file"."""
        if self.local:
            p = Path(self.pretrained, "" if at_root else (self.subfolder or ""), filename)
            if p.is_symlink() and not p.exists():
                raise CheckpointUnreadable(f"{p}: a broken link (to {os.readlink(p)}, which does not exist): "
                                           f"the checkpoint {self} is incomplete")
            return p if p.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError
        try:
            p = Path(hf_hub_download(self.pretrained, filename, subfolder=None if at_root else self.subfolder,
                                     revision=self.revision))
        except EntryNotFoundError:   # not in the repo, or offline and not in the cache
            link = self._snapshot() / ("" if at_root else (self.subfolder or "")) / filename
            if link.is_symlink() and not link.exists():   # huggingface_hub says "not cached": say why
                raise CheckpointUnreadable(f"{self}: {link} links to {os.readlink(link)}, which does not exist (a "
                                           "blob removed from the hub cache): download the checkpoint again") from None
            return None
        except Exception as e:  # noqa: BLE001 - no such repo, gated, no network...: one message names it
            raise CheckpointUnreadable(f"{self}: cannot read {self.name(filename)} through the hub cache "
                                       f"({type(e).__name__}: {e})") from e
        if p.is_symlink() and not p.exists():
            raise CheckpointUnreadable(f"{self}: {p} links to {os.readlink(p)}, which does not exist (a blob "
                                       "removed from the hub cache): download the checkpoint again")
        return p

    def _snapshot(self) -> Path:
        """The snapshot folder ``revision`` (default ``main``) resolves to in the hub cache (its ref, or the
        commit itself), as ``huggingface_hub`` lays it out; it may not exist."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        repo = Path(constants.HF_HUB_CACHE, repo_folder_name(repo_id=self.pretrained, repo_type="model"))
        ref = repo / "refs" / (self.revision or "main")
        return repo / "snapshots" / (ref.read_text().strip() if ref.is_file() else (self.revision or "main"))

    def _refs(self) -> list[str]:
        """The refs (branches, tags) the hub cache holds for this repo, by name."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        refs = Path(constants.HF_HUB_CACHE, repo_folder_name(repo_id=self.pretrained, repo_type="model"), "refs")
        return sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []

    def commit(self, fetched: Path) -> str | None:
        """The hub commit a file fetched from this checkpoint was read at: its snapshot folder's name in the
        hub cache (``models--org--name/snapshots/<commit>/...``); None for a local folder."""
        if self.local:
            return None
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        snapshots = Path(constants.HF_HUB_CACHE, repo_folder_name(repo_id=self.pretrained, repo_type="model"),
                         "snapshots")
        try:
            return Path(os.path.abspath(fetched)).relative_to(os.path.abspath(snapshots)).parts[0]
        except ValueError:
            return None


def checkpoint(pretrained: Any, subfolder: str | None = None, revision: str | None = None, *,
               what: str = "revision") -> Checkpoint:
    """The :class:`Checkpoint` of ``pretrained`` (a folder, made absolute, or a hub id) at ``revision`` (a
    branch, tag or 40-hex commit of a hub id; None or ``""``: ``main``). Raises :class:`LocalRevision` for a
    revision given with a local folder (``what``: the option that gave it, for the message)."""
    text = os.fspath(pretrained) if isinstance(pretrained, os.PathLike) else str(pretrained)
    if os.path.isdir(os.path.expanduser(text)):
        text = os.path.abspath(os.path.expanduser(text))
        if revision:
            raise LocalRevision(f"{what} {revision!r} is set, but {text} is a local folder, which has no revisions "
                                "(transformers and diffusers would ignore it and load the folder's files): give the "
                                "hub id to read that revision from the hub cache, or leave the revision unset")
    return Checkpoint(text, subfolder or None, revision or None)


# ---- which files the library opens ---------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One file a library looks for, in its order: ``name``, whether it is a shard ``index``, and whether a
    local folder's file is looked for at the folder's root before its subfolder (``diffusers``)."""

    name: str
    index: bool = False
    root_first: bool = False


def candidates(library: str) -> tuple[Candidate, ...]:
    """The weight files ``library`` (:data:`LIBRARIES`) looks for, in the order it looks, by its own constants
    (see the module docstring; ``use_safetensors`` and ``variant`` at their defaults). Imports the library."""
    if library == "transformers":
        from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
        return (Candidate(SAFE_WEIGHTS_NAME), Candidate(SAFE_WEIGHTS_INDEX_NAME, index=True),
                Candidate(WEIGHTS_NAME), Candidate(WEIGHTS_INDEX_NAME, index=True))
    if library == "diffusers":
        from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
        return (Candidate(SAFE_WEIGHTS_INDEX_NAME, index=True), Candidate(SAFETENSORS_WEIGHTS_NAME, root_first=True),
                Candidate(WEIGHTS_NAME, root_first=True))
    raise ValueError(f"unknown library {library!r}: one of {', '.join(LIBRARIES)}")


@dataclass(frozen=True)
class WeightFiles:
    """The weight files a library opens for a checkpoint: ``files`` ``((name as listed, path as fetched),
    ...)`` (one file, or the shards an index names in name order), ``index`` (the index's listed name, or
    None), ``commit`` (the hub commit they were read at, None for a local folder)."""

    checkpoint: Checkpoint
    library: str
    files: tuple[tuple[str, Path], ...]
    index: str | None = None
    commit: str | None = None

    def source(self) -> dict[str, Any]:
        """What :func:`identity` records of where the weights came from (never compared): ``pretrained``
        (the hub id, or the absolute folder), ``revision`` (the commit; None for a folder), for a hub id
        ``requested`` (the revision asked for: a branch, tag or commit; ``main`` by default), ``subfolder``,
        ``files`` (their listed names) and ``index``."""
        return {"pretrained": self.checkpoint.pretrained, "revision": self.commit, **self.checkpoint.requested(),
                "subfolder": self.checkpoint.subfolder, "files": [n for n, _ in self.files], "index": self.index}


def _explicit(ckpt: Checkpoint) -> tuple[Candidate, ...]:
    """``config.json``'s ``transformers_weights``: the one file ``transformers`` then loads, instead of looking
    for its defaults (``_get_resolved_checkpoint_files``' ``transformers_explicit_filename``)."""
    p = ckpt.fetch("config.json")
    if p is None:
        return ()
    try:
        named = json.loads(p.read_text()).get("transformers_weights")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointUnreadable(f"{ckpt.name('config.json')} of {ckpt} ({p}): not a JSON object ({e})") from e
    if not named:
        return ()
    named = str(named)
    if not named.endswith((".safetensors", ".safetensors.index.json")) and named != "adapter_model.bin":
        raise CheckpointUnreadable(f"{ckpt.name('config.json')} of {ckpt}: transformers_weights {named!r} is neither a "
                                   "safetensors file nor a safetensors index, which transformers refuses to load")
    if os.path.isabs(named) or ".." in Path(named).parts:
        raise CheckpointUnreadable(f"{ckpt.name('config.json')} of {ckpt}: transformers_weights {named!r} is not a "
                                   "file inside the checkpoint, which transformers refuses to load")
    return (Candidate(named, index=named.endswith(".safetensors.index.json")),)


def _shards(ckpt: Checkpoint, index: str, path: Path) -> list[str]:
    """The shard names ``index`` (at ``path``) lists, each a plain file name of the index's folder."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointUnreadable(f"{ckpt.name(index)} of {ckpt} ({path.resolve()}): not a shard index "
                                   f"({type(e).__name__}: {e}; expected a JSON object with a weight_map)") from e
    bad = [n for n in names if not isinstance(n, str) or os.path.basename(n) != n or n in ("", ".", "..")]
    if bad or not names:
        raise CheckpointUnreadable(f"{ckpt.name(index)} of {ckpt}: its weight_map names "
                                   + (f"{bad[0]!r}, not a file of its folder" if bad else "no file"))
    return names


def loaded_files(ckpt: Checkpoint, library: str, *, isolated: bool = False) -> WeightFiles:
    """The weight files ``library`` opens for ``ckpt`` (see the module docstring). ``isolated``: decided in a
    child process (``python -m shardcache.weights``), so that this one never imports the library (a training
    process and ``diffusers``); memoised per process while the checkpoint's folder is unchanged.

    Raises :class:`CheckpointUnreadable`: no weight file; an index that does not parse; ``file X listed in
    Y is missing``; a broken link; a hub error."""
    if isolated:
        return _in_child(ckpt, library, _state(ckpt))
    if library == "diffusers" and not ckpt.local and ckpt.revision:
        from diffusers.utils.constants import DEPRECATED_REVISION_ARGS
        if ckpt.revision in DEPRECATED_REVISION_ARGS:   # _get_model_file then loads the variant file instead
            raise CheckpointUnreadable(f"{ckpt}: revision {ckpt.revision!r} is diffusers' deprecated spelling of a "
                                       f"weights variant (it loads another file than the revision's), which is not "
                                       "supported: name the branch, tag or commit of the weights to load")
    order = (_explicit(ckpt) if library == "transformers" else ()) or candidates(library)   # the named one alone
    for c in order:
        found = (ckpt.fetch(c.name, at_root=True) if c.root_first and ckpt.local and ckpt.subfolder else None) \
            or ckpt.fetch(c.name)
        if found is None:
            continue
        if not c.index:
            return WeightFiles(ckpt, library, ((ckpt.name(c.name), found),), None, ckpt.commit(found))
        files = []
        for shard in _shards(ckpt, c.name, found):
            p = ckpt.fetch(shard)
            if p is None:
                raise CheckpointUnreadable(f"file {ckpt.name(shard)} listed in {ckpt.name(c.name)} is missing "
                                           f"({ckpt}): the checkpoint is incomplete; download it again")
            files.append((ckpt.name(shard), p))
        return WeightFiles(ckpt, library, tuple(files), ckpt.name(c.name), ckpt.commit(found))
    if not ckpt.local and ckpt.revision and not ckpt._snapshot().is_dir():
        raise CheckpointMissing(f"{ckpt}: revision {ckpt.revision} is not in the hub cache (no refs/{ckpt.revision}, "
                                f"no snapshots/{ckpt.revision}; offline): download that revision, or name one the "
                                f"cache holds (its refs: {', '.join(ckpt._refs()) or 'none'})")
    where = "" if ckpt.local else " (or it is not in the hub cache, offline)"
    raise CheckpointMissing(f"{ckpt} holds none of the weight files {library} loads "
                               f"({', '.join(c.name for c in order)}){where}: cannot tell its identity")


def _state(ckpt: Checkpoint) -> tuple:
    """What :func:`loaded_files` ``isolated`` is memoised on: the listing (names, sizes, modification times)
    of the checkpoint's folder (a hub id: of its snapshot for ``revision``, and the ref)."""
    folder = Path(ckpt.pretrained if ckpt.local else ckpt._snapshot(), ckpt.subfolder or "")
    try:
        return tuple(sorted((p.name, s.st_size, s.st_mtime_ns) for p in folder.iterdir() if (s := p.stat()))) + (
            str(folder),)
    except OSError:
        return (str(folder),)


@functools.lru_cache(maxsize=64)
def _in_child(ckpt: Checkpoint, library: str, state: tuple) -> WeightFiles:
    cmd = [sys.executable, "-m", "shardcache.weights", library, ckpt.pretrained, "--subfolder", ckpt.subfolder or "",
           "--revision", ckpt.revision or ""]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {r.returncode}"
        if r.returncode in (2, 3) and why.startswith("error: "):
            raise (CheckpointMissing if r.returncode == 3 else CheckpointUnreadable)(why[len("error: "):])
        raise CheckpointUnreadable(f"{ckpt}: {library} could not tell which weight files it loads ({why}; "
                                   f"{' '.join(cmd[1:])})")
    d = json.loads(r.stdout)
    return WeightFiles(ckpt, library, tuple((n, Path(p)) for n, p in d["files"]), d["index"], d["commit"])


# ---- reading a file ------------------------------------------------------------------------------------

def file_format(path: Path) -> str | None:
    """What ``path`` holds, from its first bytes: ``safetensors`` (an 8-byte little-endian header length
    then a JSON object), ``torch-zip`` (``torch.save``'s zip archive: ``PK\\x03\\x04``), ``torch-pickle``
    (the legacy ``torch.save`` format: a pickle, first byte 0x80), else None. Raises ``OSError``."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9:
        n = struct.unpack("<Q", head[:8])[0]
        if head[8:9] == b"{" and 0 < n <= _MAX_HEADER:
            return "safetensors"
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if head[:1] == b"\x80":
        return "torch-pickle"
    return None


def _describe(name: str, path: Path) -> str:
    """A weight file for a message: its listed name and the file it is (a hub cache's blob)."""
    return f"{name} ({path.resolve()})"


def _tensors(name: str, path: Path) -> Iterable[tuple[str, Callable[[], Any]]]:
    """``(tensor name, load)`` of every tensor of weight file ``path`` (listed as ``name``); ``load()`` reads
    that tensor only (a safetensors file). Raises :class:`CheckpointUnreadable`."""
    try:
        kind = file_format(path)
    except OSError as e:
        raise CheckpointUnreadable(f"{_describe(name, path)}: cannot be read ({e})") from e
    try:
        if kind == "safetensors":
            from safetensors import safe_open
            f = safe_open(str(path), "pt")
            return [(k, functools.partial(f.get_tensor, k)) for k in f.keys()]
        if kind in ("torch-zip", "torch-pickle"):   # what transformers / diffusers load with weights_only=True
            import torch
            sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=kind == "torch-zip")
            if not isinstance(sd, dict):
                raise ValueError(f"holds a {type(sd).__name__}, not a dict of tensors")
            return [(k, (lambda v=v: v)) for k, v in sd.items()]
    except CheckpointUnreadable:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError, UnpicklingError, RuntimeError...: named
        raise CheckpointUnreadable(f"{_describe(name, path)}: a corrupt or truncated {kind} file "
                                   f"({type(e).__name__}: {e})") from e
    with open(path, "rb") as fh:
        first = fh.read(16)
    raise CheckpointUnreadable(f"{_describe(name, path)}: neither a safetensors nor a torch weight file (its "
                               f"first bytes {first!r})")


def tensor_names(pretrained: Any, subfolder: str | None = None, *, library: str = "transformers",
                 revision: str | None = None) -> list[str]:
    """The tensor names of the files ``library`` opens for checkpoint ``pretrained`` (no tensor is read
    from a safetensors file). Raises :class:`CheckpointUnreadable`."""
    wf = loaded_files(checkpoint(pretrained, subfolder, revision), library)
    return sorted(k for n, p in wf.files for k, _ in _tensors(n, p))


@functools.lru_cache(maxsize=None)
def under(*parts: str) -> Callable[[str], str | None]:
    """A key selector for :func:`checkpoint_sha256`: the tensors whose name holds one of ``parts``
    (``vision_tower.``), named from that part on, so the same weights saved with another prefix
    (``model.vision_tower...`` by transformers 5, ``vision_tower...`` by 4.x) hash alike."""
    pat = re.compile(r"(?:^|\.)((?:" + "|".join(map(re.escape, parts)) + r").*)$")

    def select(key: str) -> str | None:
        m = pat.search(key)
        return m.group(1) if m else None
    return select


@functools.lru_cache(maxsize=32)
def _sha256(files: tuple[tuple[str, str, int, int], ...], select: Callable[[str], str | None] | None) -> str:
    import torch
    entries: dict[str, tuple[str, Callable]] = {}
    for name, path, _, _ in files:
        for key, load in _tensors(name, Path(path)):
            as_ = select(key) if select is not None else key
            if as_ is None:
                continue
            if as_ in entries:
                raise CheckpointUnreadable(f"tensor {key} is in both {entries[as_][0]} and {name}: which one "
                                           "loads is not defined")
            entries[as_] = (name, load)
    if not entries:
        raise CheckpointUnreadable(f"no tensor of {', '.join(n for n, *_ in files)} is selected: cannot tell its "
                                   "identity")
    h = hashlib.sha256()
    for as_ in sorted(entries):
        name, load = entries[as_]
        try:
            t = load().detach().to("cpu").contiguous()
        except Exception as e:  # noqa: BLE001 - a tensor's bytes past the end of a truncated file
            raise CheckpointUnreadable(f"{name}: tensor {as_} cannot be read ({type(e).__name__}: {e})") from e
        h.update(f"{as_}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def files_sha256(wf: WeightFiles, select: Callable[[str], str | None] | None = None) -> str:
    """The hash (see the module docstring) of the tensors of ``wf``'s files; cached per process by each
    file's real path, size and modification time (a file rewritten in place is hashed again)."""
    key = []
    for name, p in wf.files:
        try:
            st = p.stat()
        except OSError as e:
            raise CheckpointUnreadable(f"{_describe(name, p)}: cannot be read ({e})") from e
        key.append((name, str(p.resolve()), st.st_size, st.st_mtime_ns))
    return _sha256(tuple(key), select)


def checkpoint_sha256(pretrained: Any, subfolder: str | None = None, select: Callable[[str], str | None] | None = None,
                      *, library: str = "transformers", revision: str | None = None, isolated: bool = False,
                      what: str = "revision") -> str:
    """sha256 (hex) of the tensors of the files ``library`` opens for checkpoint ``pretrained`` (a folder or
    a hub id; ``subfolder``, ``revision``): for each selected tensor in name order its name, dtype, shape and
    raw bytes. ``select(name)`` -> the name to hash it under, or None to leave it out (:func:`under`);
    default every tensor under its own name. ``isolated``: as :func:`loaded_files`; ``what``: the option that
    gave ``revision`` (for :class:`LocalRevision`'s message).

    The same tensors saved again in the same dtype hash alike (one file or shards, another folder, the hub
    cache); other values, shapes or dtypes do not. Raises :class:`CheckpointUnreadable`."""
    return files_sha256(loaded_files(checkpoint(pretrained, subfolder, revision, what=what), library,
                                     isolated=isolated), select)


def weights_of(pretrained: Any, subfolder: str | None = None, select: Callable[[str], str | None] | None = None,
               *, library: str = "transformers", revision: str | None = None, isolated: bool = False,
               what: str = "revision"):
    """:func:`checkpoint_sha256` as a contract's value: a :class:`shards.cache.Sourced` (the hash, which alone
    is compared, with where its files were read, which a refusal names). Raises :class:`CheckpointUnreadable`."""
    from shards.cache import Sourced, source_text
    wf = loaded_files(checkpoint(pretrained, subfolder, revision, what=what), library, isolated=isolated)
    return Sourced(files_sha256(wf, select), source_text(wf.source()))


def numeric_policy(dtype: Any, device: Any = "cpu") -> dict[str, Any]:
    """What decides an encoder's float arithmetic besides its weights and inputs: the ``device`` type
    (``cpu``, ``cuda``), the compute ``dtype``, ATen's CPU kernels (``torch.backends.cpu.get_cpu_capability()``:
    ``AVX512``, ``AVX2``, ``DEFAULT`` under ``ATEN_CPU_CAPABILITY=default``, which gives other Wan latents), the
    TF32 switches (``torch.backends.cuda.matmul.allow_tf32`` -> ``tf32_matmul``,
    ``torch.backends.cudnn.allow_tf32`` -> ``tf32_cudnn``, ``torch.get_float32_matmul_precision()``) and cuDNN's
    (``cudnn_enabled``, ``cudnn_benchmark``: another algorithm per run, ``cudnn_deterministic``), as in effect
    now. Part of the encoder's ``describe()``, so of the cache's fingerprint: a rerun, resume or add-field
    under other numerics is refused (:func:`precompute.identity.check_job_record`)."""
    import torch
    return {"device": torch.device(device).type,
            "dtype": str(dtype).replace("torch.", ""), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_enabled": bool(torch.backends.cudnn.enabled),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic)}


def identity(pretrained: Any, *, dtype: Any, device: Any = "cpu", library: str = "transformers",
             subfolder: str | None = None, revision: str | None = None,
             select: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """The keys an encoder's ``describe()`` adds for its identity: ``checkpoint_sha256`` of the files
    ``library`` opens for ``pretrained`` (None when the encoder was built in memory: no ``pretrained``),
    ``numerics`` (:func:`numeric_policy`) and :data:`SOURCE_KEY` (:meth:`WeightFiles.source`, never compared:
    the fingerprint leaves it out). Raises :class:`CheckpointUnreadable`."""
    out: dict[str, Any] = {"checkpoint_sha256": None}
    if pretrained:
        wf = loaded_files(checkpoint(pretrained, subfolder, revision), library)
        out["checkpoint_sha256"] = files_sha256(wf, select)
        out[SOURCE_KEY] = wf.source()
    out["numerics"] = numeric_policy(dtype, device)
    return out


def source(pretrained: Any, probe: str, subfolder: str | None = None, revision: str | None = None, *,
           what: str = "revision") -> dict[str, Any]:
    """Where a checkpoint without weights (a tokenizer) was read: ``pretrained`` (hub id, or the absolute
    folder), ``revision`` (the commit ``probe``, one of its files, was read at; None for a folder or
    when it has no such file), for a hub id ``requested`` (the revision asked for, ``main`` by default) and
    ``subfolder``. Raises :class:`LocalRevision` for a ``revision`` with a local folder."""
    ckpt = checkpoint(pretrained, subfolder, revision, what=what)
    p = ckpt.fetch(probe)
    return {"pretrained": ckpt.pretrained, "revision": ckpt.commit(p) if p is not None else None,
            **ckpt.requested(), "subfolder": ckpt.subfolder}


def main(argv: list[str] | None = None) -> int:
    """``python -m shardcache.weights LIBRARY PRETRAINED [--subfolder S] [--revision R]``: the weight files
    LIBRARY opens, as one JSON object (``files``: ``[[name, path], ...]``, ``index``, ``commit``); exit 2 with
    ``error: ...`` for :class:`CheckpointUnreadable`, 3 for :class:`CheckpointMissing`."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m shardcache.weights")
    p.add_argument("library", choices=LIBRARIES)
    p.add_argument("pretrained")
    p.add_argument("--subfolder", default="")
    p.add_argument("--revision", default="")
    a = p.parse_args(argv)
    try:
        wf = loaded_files(checkpoint(a.pretrained, a.subfolder, a.revision), a.library)
    except CheckpointUnreadable as e:
        print(f"error: {e}", file=sys.stderr)
        return 3 if isinstance(e, CheckpointMissing) else 2
    print(json.dumps({"files": [[n, str(p)] for n, p in wf.files], "index": wf.index, "commit": wf.commit}))
    return 0


__all__ = ["GEMMA3_VISION", "LIBRARIES", "SOURCE_KEY", "Candidate", "Checkpoint", "CheckpointMissing",
           "CheckpointUnreadable", "LocalRevision", "WeightFiles", "candidates", "checkpoint", "checkpoint_sha256",
           "file_format", "files_sha256", "identity", "loaded_files", "numeric_policy", "source", "tensor_names",
           "under", "weights_of"]

if __name__ == "__main__":
    sys.exit(main())
