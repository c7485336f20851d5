"""A sample is a conversation: turns with roles, text and media items in their places.

Every manifest shape becomes a :class:`Conversation` (see :mod:`precompute.manifests`):

* Higgs-Audio ChatML (``boson_multimodal.data_types.ChatMLSample``): ``messages`` of
  ``{role, content}`` where ``content`` is a string, one item dict, or a list of strings and item
  dicts (``{"type": "text", "text"}``, ``{"type": "audio", "audio_url" | "raw_audio" (base64),
  "offset", "duration"}``, ``{"type": "image", "image_url"}``); ``start_index``: turns before it
  are context, never trained (Higgs-Audio's ``prepare_chatml_sample``).
* LLaVA: ``conversations`` of ``{from: human|gpt|system, value}``; each ``<image>`` in a value is
  where image ``k`` goes (LLaVA's convention); a record with an image and no ``<image>`` gets it at
  the start of the first user turn. Every round is kept.
* Flat rows (JSONL/CSV/Parquet with ``text``, ``audio``, ``image``): the one-turn case. With audio
  (TTS): ``user: [image] text`` -> ``assistant: audio``. Without audio (captioning):
  ``user: image`` -> ``assistant: text``.

Audio items in a user/system turn are *input* (``direction = "in"``), in an assistant turn
*output* (``"out"``), as Higgs-Audio renders them (``<|AUDIO|>`` vs ``<|AUDIO_OUT|>``).

A ChatML message's ``recipient`` (Higgs-Audio's ``Message.recipient``) is kept with its turn
(:attr:`Turn.recipient`, in the sample's ``json`` conversation) and rendered as Higgs-Audio renders
it (:mod:`precompute.chat`, ``chat_template: llama3``).

Malformed values raise :class:`RowError` naming the field (e.g. ``messages[2].content[1].audio_url``);
the manifest reader turns it into a ``malformed_row`` reject, so no value can abort a job. What is
checked (:func:`as_text`, :func:`as_path`, :func:`check_json`): text is valid Unicode (no lone
surrogate: it could not be written as UTF-8), paths hold no NUL, are at most :data:`MAX_PATH_BYTES`
long and stay inside the media root (:class:`MediaRoot`), metadata stored verbatim is plain JSON
(finite numbers, at most :data:`MAX_JSON_DEPTH` levels and :data:`MAX_JSON_BYTES` bytes).
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shards.tokens import IMAGE

from .sources import OUTSIDE_ROOT, MediaPath

ROLES = ("system", "user", "assistant")
LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
               "system": "system"}
IMAGE_TOKEN = IMAGE  # LLaVA's placeholder in a turn's text


#: the longest media path (bytes of UTF-8): Linux's PATH_MAX
MAX_PATH_BYTES = 4096
#: metadata stored verbatim in a sample's json (ChatML ``misc``): the deepest nesting and the most bytes
MAX_JSON_DEPTH = 32
MAX_JSON_BYTES = 1 << 20


class RowError(ValueError):
    """A manifest value that cannot be used. ``field`` names it (dotted/indexed path)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class MediaRoot:
    """The folder media paths are relative to and must stay inside (``--root``; default: the
    manifest's folder), unless ``allow_outside`` (``allow_outside_root: true``).

    :meth:`resolve` makes a path absolute against the root; a path that leaves it (``../``, an
    absolute path elsewhere, or a symlink, of the file or of a folder on its way, pointing out)
    raises :class:`RowError` naming the field and saying how to allow it. The recorded source is
    ``root / value`` as written (symlinks are resolved only for the check), as a
    :class:`precompute.sources.MediaPath` carrying the real root: the file is checked again on the
    descriptor it is opened with (:func:`precompute.sources.open_media`), so a symlink changed after
    this check cannot lead out either.
    """

    def __init__(self, root: str | os.PathLike, allow_outside: bool = False):
        self.root = Path(os.path.abspath(root))
        self.allow_outside = bool(allow_outside)
        self._real_root = os.path.realpath(self.root)
        self._real_dirs: dict[str, str] = {}
        self._folders: dict[str, tuple[str, str, bool]] = {}  # a value's folder part -> what _folder makes of it

    @classmethod
    def of(cls, base: "MediaRoot | str | os.PathLike") -> "MediaRoot":
        return base if isinstance(base, MediaRoot) else cls(base)

    @staticmethod
    def _under(path: str, root: str) -> bool:
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

    def _real(self, path: str) -> str:
        """``realpath(path)`` with the folder's resolution cached (one ``lstat`` per file)."""
        folder, name = os.path.split(path)
        real_dir = self._real_dirs.get(folder)
        if real_dir is None:
            real_dir = self._real_dirs[folder] = os.path.realpath(folder)
        full = os.path.join(real_dir, name)
        return os.path.realpath(full) if os.path.islink(full) else full

    def _folder(self, value: str) -> tuple[str, str, str, bool] | None:
        """``(str(root / folder), its real path, the file name, whether that real folder is inside the root)``
        of ``value``'s folder part, made once per folder (pathlib's join, ``normpath``, ``realpath``); None
        for a value the per-folder form does not cover (a last part ``.``/``..``, a leading ``//``)."""
        folder, sep, name = value.rpartition("/")
        if not name or name in (".", "..") or value.startswith("//"):
            return None
        prefix = folder + sep  # "" (no folder), "/" (the file system's root), "a/b/"
        got = self._folders.get(prefix)
        if got is None:
            if len(self._folders) > 65536:
                self._folders.clear()
            base = str(self.root / prefix) if prefix else str(self.root)
            real = os.path.realpath(os.path.normpath(base))
            got = self._folders[prefix] = (base, real, self._under(real, self._real_root))
        return got[0], got[1], name, got[2]

    def resolve(self, value: str, name: str) -> str:
        """``value`` (a checked, non-empty path text) as an absolute path string (a
        :class:`~precompute.sources.MediaPath` knowing the root it must stay inside). The folder's join and
        real path are made once per folder; each file costs one ``lstat`` (is it a symlink?)."""
        folder = self._folder(value)
        if folder is None:
            path = str(self.root / value)
        else:
            base, real_dir, file, inside = folder
            path = base + file if base.endswith("/") else f"{base}/{file}"
        if self.allow_outside:
            return MediaPath(path, None)
        if folder is None:
            norm = os.path.normpath(path)
            real = self._real(norm)  # resolves ../ and every symlink: a root that is itself a link is fine
        else:
            full = real_dir + file if real_dir.endswith("/") else f"{real_dir}/{file}"
            if not os.path.islink(full) and inside:
                return MediaPath(path, self._real_root)
            norm, real = os.path.normpath(path), (os.path.realpath(full) if os.path.islink(full) else full)
        if not self._under(real, self._real_root):
            linked = self._under(norm, os.path.normpath(self.root))
            where = f"{real} (through a symlink)" if linked else norm
            raise RowError(name, f"{value!r} is {OUTSIDE_ROOT} {self.root}: it resolves to {where}; "
                                 "pass --root DIR (a folder holding every media file) or set "
                                 "allow_outside_root: true (--allow_outside_root) to read it")
        return MediaPath(path, self._real_root)


@dataclass
class AudioItem:
    """One audio item. ``source``: absolute path (or ``"<raw_audio>"`` with ``data``: the decoded
    bytes of a base64 ``raw_audio``); ``offset_s``/``duration_s`` (seconds) select a window;
    ``direction``: ``"in"`` (user/system turn) or ``"out"`` (assistant turn); ``turn``: index of
    its turn; ``speaker``: the item's speaker (the sample's for output items when not given)."""

    source: str
    turn: int
    direction: str
    offset_s: float = 0.0
    duration_s: float | None = None
    speaker: str = ""
    data: bytes | None = None


@dataclass
class ImageItem:
    """One image item: absolute path and the index of its turn."""

    source: str
    turn: int


@dataclass
class Part:
    """One piece of a turn's content: ``type`` text (``text``) | audio | image (``item`` = index
    into :attr:`Conversation.audio` / :attr:`Conversation.images`)."""

    type: str
    text: str = ""
    item: int = -1


@dataclass
class Turn:
    """One turn: its role, its parts in order and, for ChatML, the message's ``recipient``."""

    role: str
    parts: list[Part] = field(default_factory=list)
    recipient: str | None = None


@dataclass
class Conversation:
    """Turns in order plus the media they reference (in order of appearance)."""

    turns: list[Turn] = field(default_factory=list)
    start_index: int | None = None
    audio: list[AudioItem] = field(default_factory=list)
    images: list[ImageItem] = field(default_factory=list)

    def trained(self, turn: int) -> bool:
        """Whether turn ``turn`` is a target: an assistant turn at or after ``start_index``."""
        return self.turns[turn].role == "assistant" and (self.start_index is None or turn >= self.start_index)

    @property
    def text(self) -> str:
        """All text of the conversation, one turn a line (for listings and ``empty_text`` checks)."""
        return "\n".join(" ".join(p.text for p in t.parts if p.type == "text").strip() for t in self.turns).strip()

    @property
    def sources(self) -> list[str]:
        return [a.source for a in self.audio] + [i.source for i in self.images]

    def to_json(self) -> dict[str, Any]:
        """JSON-able form stored in each sample's ``json`` member (no raw audio bytes)."""
        return {
            "turns": [{"role": t.role, "parts": [
                {"type": "text", "text": p.text} if p.type == "text" else {"type": p.type, "item": p.item}
                for p in t.parts], **({"recipient": t.recipient} if t.recipient is not None else {})}
                for t in self.turns],
            "start_index": self.start_index,
        }

    # -- building -----------------------------------------------------------------------------
    def add_turn(self, role: str) -> Turn:
        self.turns.append(Turn(role))
        return self.turns[-1]

    def add_text(self, text: str) -> None:
        self.turns[-1].parts.append(Part("text", text=text))

    def add_audio(self, item: AudioItem) -> None:
        self.turns[-1].parts.append(Part("audio", item=len(self.audio)))
        self.audio.append(item)

    def add_image(self, item: ImageItem) -> None:
        self.turns[-1].parts.append(Part("image", item=len(self.images)))
        self.images.append(item)


# -- value checks --------------------------------------------------------------------------------
def check_unicode(value: str, name: str) -> str:
    """``value`` unchanged when it can be written as UTF-8, else :class:`RowError` (a lone
    surrogate, e.g. from a JSON ``"\\ud800"``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(name, f"not valid Unicode text: lone surrogate {value[e.start]!r} at character "
                             f"{e.start}") from None
    return value


def as_text(value: Any, name: str) -> str:
    """``value`` as a str (None -> ""); numbers are accepted as their text, anything else raises;
    text that is not valid Unicode raises (:func:`check_unicode`)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, str):
        return check_unicode(value, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RowError(name, f"expected text, got {type(value).__name__}")


def as_path(value: Any, name: str, base: "MediaRoot | Path") -> str | None:
    """A media path (str) made absolute against the media root (:meth:`MediaRoot.resolve`: a path
    outside it raises); None/"" -> None; other types, a NUL, invalid Unicode or a path longer than
    :data:`MAX_PATH_BYTES` raise :class:`RowError`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if not isinstance(value, str):
        raise RowError(name, f"expected a file path (string), got {type(value).__name__} {value!r:.40}")
    value = check_unicode(value, name).strip()
    if not value:
        return None
    if "\0" in value:
        raise RowError(name, "path contains a NUL byte")
    if len(value.encode()) > MAX_PATH_BYTES:
        raise RowError(name, f"path of {len(value.encode())} bytes, longer than {MAX_PATH_BYTES}")
    return MediaRoot.of(base).resolve(value, name)


def check_json(value: Any, name: str) -> Any:
    """``value`` unchanged when it can be stored verbatim in a sample's json: dicts with string
    keys, lists, strings (valid Unicode), finite numbers, booleans, None; at most
    :data:`MAX_JSON_DEPTH` levels and :data:`MAX_JSON_BYTES` bytes. Raises :class:`RowError`
    naming the place (``misc.a[3]``)."""
    stack = [(value, name, 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RowError(where, f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(v, str):
            check_unicode(v, where)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise RowError(where, f"{v!r} is not a finite number (JSON has none)")
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise RowError(where, f"key {k!r:.40} is not a string")
                check_unicode(k, f"{where} key")
                stack.append((x, f"{where}.{k}", depth + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
        elif not (v is None or isinstance(v, (bool, int))):
            raise RowError(where, f"expected a JSON value, got {type(v).__name__}")
    n = len(json.dumps(value, ensure_ascii=False).encode())
    if n > MAX_JSON_BYTES:
        raise RowError(name, f"{n} bytes of JSON, more than {MAX_JSON_BYTES}")
    return value


def as_seconds(value: Any, name: str, *, allow_none: bool) -> float | None:
    """A non-negative finite number of seconds (numeric strings accepted); absent (None, an empty
    cell) is None where ``allow_none``, else 0. NaN and infinities raise :class:`RowError`: a NaN
    ``offset``/``duration`` used to be read as absent, the whole clip kept instead of the window."""
    if value is None or (isinstance(value, str) and not value.strip()):
        if allow_none:
            return None
        return 0.0
    if isinstance(value, bool):
        raise RowError(name, f"expected seconds, got {value!r}")
    if isinstance(value, str):
        check_unicode(value, name)
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise RowError(name, f"expected a number of seconds, got {value!r:.40}") from None
    if not math.isfinite(x) or x < 0:
        raise RowError(name, f"must be a finite number >= 0, got {value!r:.40}")
    return x


# -- shapes ---------------------------------------------------------------------------------------
def _audio_item(d: dict, name: str, base: MediaRoot, turn: int, role: str, speaker: str) -> AudioItem:
    direction = "out" if role == "assistant" else "in"
    offset = as_seconds(d.get("offset"), f"{name}.offset", allow_none=False)
    duration = as_seconds(d.get("duration"), f"{name}.duration", allow_none=True)
    if duration is not None and duration <= 0:
        raise RowError(f"{name}.duration", f"must be > 0, got {d.get('duration')!r}")
    spk = as_text(d.get("speaker"), f"{name}.speaker") or (speaker if direction == "out" else "")
    url = d.get("audio_url")
    raw = d.get("raw_audio")
    if raw not in (None, ""):
        if not isinstance(raw, str):
            raise RowError(f"{name}.raw_audio", f"expected base64 text, got {type(raw).__name__}")
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RowError(f"{name}.raw_audio", f"not valid base64 ({e})") from None
        return AudioItem("<raw_audio>", turn, direction, offset, duration, spk, data=data)
    path = as_path(url, f"{name}.audio_url", base)
    if path is None:
        raise RowError(name, "audio item has neither audio_url nor raw_audio")
    return AudioItem(path, turn, direction, offset, duration, spk)


def _image_url(d: dict, name: str) -> Any:
    url = d.get("image_url")
    if isinstance(url, dict):  # OpenAI style {"type": "image_url", "image_url": {"url": ...}}
        url = url.get("url")
    if url is None:
        url = d.get("image")
    if url is None:
        raise RowError(name, "image item has no image_url")
    return url


def _turns(rec: dict, name: str) -> list:
    """``rec[name]`` as a non-empty list of turns, else :class:`RowError`."""
    turns = rec.get(name)
    if not isinstance(turns, list):
        raise RowError(name, f"expected a list of turns, got {type(turns).__name__}")
    if not turns:
        raise RowError(name, "no turns")
    return turns


def from_chatml(rec: dict, base: MediaRoot | Path) -> tuple[Conversation, str]:
    """Higgs-Audio ChatML record -> (conversation, speaker). ``base``: the media root (a folder:
    paths must stay inside it). Raises :class:`RowError`."""
    base = MediaRoot.of(base)
    messages = _turns(rec, "messages")
    misc = rec.get("misc")
    if misc is not None and not isinstance(misc, dict):
        raise RowError("misc", f"expected an object, got {type(misc).__name__}")
    speaker = as_text(rec.get("speaker"), "speaker") or as_text((misc or {}).get("speaker"), "misc.speaker")
    conv = Conversation()
    si = rec.get("start_index")
    if si is not None:  # (NaN included: refused, not read as absent)
        if isinstance(si, bool) or not isinstance(si, (int, float)) or not math.isfinite(si) or si != int(si) \
                or not 0 <= si <= len(messages):
            raise RowError("start_index", f"expected an integer in [0, {len(messages)}], got {si!r:.40}")
        conv.start_index = int(si)
    for i, msg in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RowError(name, f"expected an object with role and content, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RowError(f"{name}.role", f"expected one of {', '.join(ROLES)}, got {role!r:.40}")
        turn = conv.add_turn(role)
        if msg.get("recipient") is not None:
            turn.recipient = as_text(msg["recipient"], f"{name}.recipient")
        content = msg.get("content")
        items = content if isinstance(content, list) else [content]
        for j, item in enumerate(items):
            iname = f"{name}.content" + (f"[{j}]" if isinstance(content, list) else "")
            if item is None:
                continue
            if isinstance(item, str):
                conv.add_text(as_text(item, iname))
                continue
            if not isinstance(item, dict):
                raise RowError(iname, f"expected text or an item object, got {type(item).__name__}")
            kind = item.get("type")
            if kind == "text":
                conv.add_text(as_text(item.get("text"), f"{iname}.text"))
            elif kind == "audio":
                conv.add_audio(_audio_item(item, iname, base, i, role, speaker))
            elif kind in ("image", "image_url"):
                path = as_path(_image_url(item, iname), f"{iname}.image_url", base)
                if path is None:
                    raise RowError(f"{iname}.image_url", "empty image path")
                conv.add_image(ImageItem(path, i))
            else:
                raise RowError(f"{iname}.type", f"expected text, audio or image, got {kind!r:.40}")
    return conv, speaker


def from_llava(rec: dict, base: MediaRoot | Path) -> Conversation:
    """LLaVA record (``id``, ``image`` (path or list), ``conversations``) -> conversation;
    ``base`` as in :func:`from_chatml`."""
    base = MediaRoot.of(base)
    turns = _turns(rec, "conversations")
    images = rec.get("image")
    images = images if isinstance(images, list) else [images]
    paths = [as_path(p, "image" if len(images) == 1 else f"image[{k}]", base) for k, p in enumerate(images)]
    paths = [p for p in paths if p]
    conv = Conversation()
    n_tokens = 0
    for i, t in enumerate(turns):
        name = f"conversations[{i}]"
        if not isinstance(t, dict):
            raise RowError(name, f"expected an object with from and value, got {type(t).__name__}")
        role = LLAVA_ROLES.get(t.get("from")) if isinstance(t.get("from"), str) else None
        if role is None:
            raise RowError(f"{name}.from", f"expected human or gpt, got {t.get('from')!r:.40}")
        value = as_text(t.get("value"), f"{name}.value")
        conv.add_turn(role)
        for k, piece in enumerate(value.split(IMAGE_TOKEN)):
            if k:
                if n_tokens >= len(paths):
                    raise RowError(f"{name}.value", f"more {IMAGE_TOKEN} tokens than images ({len(paths)})")
                conv.add_image(ImageItem(paths[n_tokens], i))
                n_tokens += 1
            if piece:
                conv.add_text(piece)
    if n_tokens == 0 and paths:  # LLaVA convention: the image goes first in the first user turn
        first = next((i for i, t in enumerate(conv.turns) if t.role == "user"), 0)
        for k, p in enumerate(paths):
            conv.turns[first].parts.insert(k, Part("image", item=k))
            conv.images.append(ImageItem(p, first))
    elif n_tokens != len(paths):
        raise RowError("conversations", f"{n_tokens} {IMAGE_TOKEN} token(s) but {len(paths)} image(s)")
    return conv


def from_flat(text: str, audio: str | None, image: str | None, speaker: str, offset_s: float,
              duration_s: float | None) -> Conversation:
    """A flat row as a one-turn conversation (see the module docstring)."""
    conv = Conversation()
    conv.add_turn("user")
    if image:
        conv.add_image(ImageItem(image, 0))
    if audio:
        if text:
            conv.add_text(text)
        conv.add_turn("assistant")
        conv.add_audio(AudioItem(audio, 1, "out", offset_s, duration_s, speaker))
    else:
        conv.add_turn("assistant")
        if text:
            conv.add_text(text)
    return conv
