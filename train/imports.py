"""What a training process must never import, and how it keeps them out.

Decoders and VAEs belong to stage one: a step reads cached tensors only. ``transformers`` and ``peft``
import soundfile and PIL for optional audio / image helpers when they can; :func:`blocked_imports`
makes those imports fail inside a block, so the helpers are skipped (tests/test_train_* check that a
training process never loads them).
"""
from __future__ import annotations

import contextlib
import sys

#: modules a training process must never load (decoders and VAEs belong to stage one)
FORBIDDEN_MODULES = ("librosa", "soundfile", "PIL", "diffusers")


@contextlib.contextmanager
def blocked_imports(names: tuple[str, ...] = FORBIDDEN_MODULES):
    """Make ``import NAME`` fail (and ``importlib.util.find_spec`` return None) inside the block.

    peft imports transformers, whose optional audio/image helpers would otherwise load soundfile
    and PIL into the training process; with them "absent" transformers skips those helpers.
    """
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for n in added:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


__all__ = ["FORBIDDEN_MODULES", "blocked_imports"]
