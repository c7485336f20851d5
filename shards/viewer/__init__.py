"""``shardcache shards view``: a local web viewer of a cache, read by the project's own readers.

What a batch holds, shown to a person: the index as a grid (each sample's text, a thumbnail and a
player, sortable, searchable, filtered by the condition of ``shards query``, with histograms), the
rejects, the encoders and preprocessing the manifest records; per sample the conversation token by
token with its labels, a player per cached audio item, the codes, the images as stage one saw them,
the latents channel by channel, the image features' norms and the sample's JSON. See docs/viewer.md.

Modules (one concern each):

* :mod:`.data`: the cache being viewed (:class:`~.data.ViewedCache`): opened without reading what
  grows with the cache, its views (filter, search, sort), pages, histograms, one sample read with
  :class:`shards.ShardReader`.
* :mod:`.rows`: ``index.parquet`` read lazily (footer counts, the scalar columns in the background,
  the members of the rows a page shows).
* :mod:`.text`: each sample's text from its json member, and the side table of the whole cache's
  text (kept in the viewer's own folder, never the cache's).
* :mod:`.tokens`: one piece of text per ``input_ids`` token, from the tokenizer the cache records,
  found on this machine only and loaded in the background.
* :mod:`.images`: a source image as stage one gave it to the encoder (Pillow), and thumbnails.
* :mod:`.media`: WAV, PNG and SVG made from cached arrays (stdlib ``wave``, matplotlib).
* :mod:`.pages`: what each page shows, as plain values for the templates.
* :mod:`.guard`: what is answered, and to whom (``Host``, ``Sec-Fetch-Site``, ``Origin``) and the
  headers every response carries.
* :mod:`.app`: routes a request to a response (no sockets: tests call it directly); :mod:`.server`
  serves it over HTTP with the standard library's threading server, and stops a filter whose client
  left.
* :mod:`.background`: the daemon threads of the work done after the first page, joined at exit and on close.
* ``templates/`` (Jinja2, autoescaped) and ``static/`` (one stylesheet, one icon; no script).

Nothing here imports stage one (``precompute``), the loaders or training (a remote cache is opened by
:mod:`shards.mirror`, as the loaders open it). Nothing here writes a cache: every route
is a GET, the only files served are those of ``static/`` (by name, from a fixed list) and what is
derived from a sample found by its key in the index.
"""
from __future__ import annotations
