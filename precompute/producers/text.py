"""``input_ids`` and ``labels``: the conversation rendered through the chat template.

Rendering is cheap and can reject a row (placeholder mismatch, no trained token), so it happens
while decoding (:func:`precompute.prepare.prepare`, :mod:`precompute.chat`); this producer hands
the result to the writer.
"""
from __future__ import annotations

from typing import Any

from .base import Producer, Timer


class TextProducer(Producer):
    """``input_ids`` / ``labels`` int32 ``(L,)`` of each sample (see :mod:`precompute.chat`)."""

    name = "text"
    outputs = ("input_ids", "labels")
    host_only = True
    directions = frozenset()

    def __init__(self, tokenizer: Any, template: str):
        self.tokenizer, self.template = tokenizer, template

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"tokenizer": self.tokenizer.describe(), "template": self.template}

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        return [{"input_ids": s.input_ids, "labels": s.labels} for s in samples]
