"""``shardcache shards view``: a local web viewer of a cache, read by the project's own readers.

What a batch holds, shown to a person: the index paged in index order with a DuckDB filter (the
condition of ``shards query``), the rejects, the encoders and preprocessing the manifest records;
per sample the conversation token by token with its labels, a player per cached audio item, the
codes, the images as stage one saw them, the latents channel by channel, the image features' norms
and the sample's JSON. See docs/viewer.md.

Modules (one concern each):

* :mod:`.data`: the cache being viewed (:class:`~.data.ViewedCache`): opened once with
  :meth:`shards.Cache.open` (a URL's files through :class:`shards.storage.RemoteFolder`), pages of
  the index, the filter, rejects, one sample read with :class:`shards.ShardReader`.
* :mod:`.tokens`: one piece of text per ``input_ids`` token, from the tokenizer the cache records.
* :mod:`.media`: WAV, PNG and SVG made from cached arrays (stdlib ``wave``, matplotlib).
* :mod:`.pages`: what each page shows, as plain values for the templates.
* :mod:`.app`: routes a request to a response (no sockets: tests call it directly); :mod:`.server`
  serves it over HTTP with the standard library's threading server.
* ``templates/`` (Jinja2, autoescaped) and ``static/`` (one stylesheet, one script).

The one place in :mod:`shards` that uses stage one's code, and only where it is installed, when a
page needs it: the cache's text tokenizer is loaded with :func:`precompute.encoders.load_text_tokenizer`
and source images decoded with :func:`precompute.add_field.image_loader` (the recorded
preprocessing), so the viewer shows them exactly as stage one made them; without the ``[precompute]``
extra the pages show token ids and say why the source images are not shown.

Nothing here writes: every route is a GET, the only files served are the stylesheet and script of
``static/`` (by name, from a fixed list) and what is derived from a sample found by its key in the
index.
"""
from __future__ import annotations
