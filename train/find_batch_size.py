"""``python -m train.find_batch_size``: see :mod:`train.batch_size`."""
import sys

from .batch_size import main

if __name__ == "__main__":
    sys.exit(main())
