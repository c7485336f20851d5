"""``python -m tools.testing --out models``: build the tiny random test models."""
import sys

from . import main

sys.exit(main())
