"""``package.module:callable`` specs: the one way both stages name user code (an encoder factory
``--audio_tokenizer.factory mypkg.codec:make``, a model ``--model.name mypkg.model:build``, a loader class)."""
from __future__ import annotations

import importlib
from typing import Any


def load_factory(spec: str) -> Any:
    """Resolve ``"package.module:attr[.attr...]"`` to the callable it names.

    Raises:
        ValueError: ``spec`` is not of the form ``module:callable``.
        ImportError: the module cannot be imported (the message names it and says to check PYTHONPATH).
        AttributeError: the module has no such attribute.
        TypeError: the attribute is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"expected 'package.module:callable' (a module:factory spec), got {spec!r}")
    mod_name, attr = spec.split(":")
    if not mod_name or not attr:
        raise ValueError(f"expected 'package.module:callable' (a module:factory spec), got {spec!r}")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"{spec!r}: cannot import module {mod_name!r}: {e} (is it on PYTHONPATH?)") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{spec!r}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec!r} is not callable ({type(obj).__name__})")
    return obj


__all__ = ["load_factory"]
