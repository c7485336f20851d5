"""``python -m train``: see :mod:`train.cli`."""
import sys

from .cli import main

sys.exit(main())
