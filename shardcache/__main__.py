"""``python -m shardcache ...``: see :mod:`shardcache.cli`."""
import sys

from .cli import main

sys.exit(main())
