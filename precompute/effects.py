"""What changing an option does to a cache (:class:`Effect`): stage one's vocabulary of identity, declared with
each option (:func:`shardcache.config.option`'s ``effect``), with each key of an encoder's or a producer's spec
(their ``OPTION_EFFECTS``) and with add-field's options; :mod:`precompute.identity` derives the cache's
fingerprint, the row digests and the recorded batch policy from these declarations (docs/trust.md's table)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

#: the kinds of effect (docs/trust.md's option table): what changing the option does to a cache
KINDS = ("bytes", "filter", "batch", "operational", "spec")
#: which rows a ``filter`` decides: rows with audio, rows with images, every row, the reading of the
#: manifest itself (its decision is in the row as read), or the rows a rerun finds no longer in the manifest
SCOPES = ("audio", "image", "row", "read", "rerun")


@dataclasses.dataclass(frozen=True)
class Effect:
    """What changing an option does to a cache, declared with the option (:func:`shardcache.config.option`, an encoder's
    ``OPTION_EFFECTS``, a producer's), from which stage one and add-field derive identity:

    * ``bytes``: changes stored bytes. ``via="fingerprint"``: the value itself is in the cache's
      fingerprint (a rerun with another value is refused, ``FingerprintMismatch``); ``via="identity"``:
      through what it loads (a path to weights, a tokenizer), so the encoder's ``describe()`` (weights
      sha256, config, vocabulary) is what the fingerprint holds, not the value.
    * ``filter``: decides which rows are kept; its value is in the digest of every row of ``scope``
      (:data:`SCOPES`), so a rerun re-decides exactly those rows. ``scope="read"``: decided while the
      manifest is read; the row as read is in its digest.
    * ``batch``: how encoder calls are formed and run (batch sizes, chunking, device type): recorded
      when a cache is started and compared on every resume (another policy is refused: on a GPU a
      clip's codes depend on its batch).
    * ``operational``: changes no stored byte and no row's decision (workers, progress, checks).
    * ``spec``: a mapping whose keys are declared by the class it names (an encoder's
      ``OPTION_EFFECTS``, a producer's): :mod:`precompute.identity` walks them.

    ``canonical``: the form the fingerprint records (aliases of one value give one fingerprint).
    """

    kind: str
    via: str = ""
    scope: str = ""
    canonical: Callable[[Any], Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS or (self.kind == "filter") != bool(self.scope) or self.scope not in ("", *SCOPES):
            raise ValueError(f"not an effect: {self}")
        if self.kind == "bytes" and self.via not in ("fingerprint", "identity"):
            raise ValueError(f"a bytes effect goes into the fingerprint or the encoder's identity, got {self.via!r}")

    def words(self) -> str:
        """One cell of docs/trust.md's table: the kind and where it goes."""
        return {"bytes": f"bytes (in the {'fingerprint' if self.via == 'fingerprint' else 'encoder identity'})",
                "filter": {"read": "filter (the row as read: in its digest)",
                           "rerun": "filter (rows no longer in the manifest: decided by every rerun)"}.get(
                    self.scope, f"filter ({self.scope} rows: in their digests)"),
                "batch": "batch policy (recorded, compared on resume)", "operational": "operational (no byte)",
                "spec": "per key (below)"}[self.kind]


BYTES = Effect("bytes", via="fingerprint")
IDENTITY = Effect("bytes", via="identity")
BATCH = Effect("batch")
OPERATIONAL = Effect("operational")
SPEC = Effect("spec")
#: the filters of the rows with audio, with images, of every row, of the manifest's reading, of a rerun's removed rows
AUDIO_ROWS, IMAGE_ROWS, EVERY_ROW, AS_READ, RERUN = (Effect("filter", scope=s) for s in SCOPES)
