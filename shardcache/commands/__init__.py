"""Commands of the ``shardcache`` line that sit above both stages (the layer of ``shardcache.cli``,
``shards.cli``, ``shards.commands`` and ``shards.viewer``: docs/layers.md). A stage never imports one."""
