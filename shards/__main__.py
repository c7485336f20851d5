"""``python -m shards ...``: the ``shards`` command line (see :mod:`shards.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
