"""shardcache: encode audio codes, VAE latents and chat-template token ids once into WebDataset
shards (stage one, :mod:`precompute`), then train from the cached tensors (stage two,
:mod:`loaders` + :mod:`train`).

This package holds what both stages share and nothing of the format (:mod:`shards` is the format
and imports nothing from here): :mod:`shardcache.config` (the configuration mechanism) and
:mod:`shardcache.cli` (the ``shardcache`` command: ``shardcache precompute | train | shards ...``).
"""
