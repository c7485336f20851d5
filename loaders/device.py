"""Move batches to the training device one step ahead, so the copy overlaps the step.

:class:`DevicePrefetcher` wraps any iterator of batches. On CUDA it issues the host-to-device copy
of batch ``k+1`` (``convert(batch, device)``, non-blocking, from pinned memory) on a side stream as
soon as batch ``k`` is handed out, so the copy runs while the model computes on ``k``; before
batch ``k+1`` is returned, the compute stream waits for the side stream (a GPU-side wait: no host
sync) and every tensor is marked as used by the compute stream (``record_stream``), so the
caching allocator does not reuse its memory early. On a CPU device it only applies ``convert``.

The host time spent inside ``next()`` is the step's data wait (what the training loop logs as
``data_wait``); with the copy overlapped it is the time to get batch ``k+1`` from the loader plus
the launch of its copy.

Exact resume: on CUDA the loader has already handed out one batch more than the caller has
received, so its ``state_dict()`` is one batch ahead. Pass ``state=loader.state_dict``: the
prefetcher records the loader's state right after taking each batch, and :attr:`state` is the
state after the batch last returned to the caller (save that in checkpoints).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from shards import fields as registry


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Every tensor of ``batch`` on ``device`` (non-blocking, no host sync), each field's tensor in
    the dtype its model sees: a compact batch (the loader's ``compact=True``: int16 PCM, int16 codes,
    int32 ids, float16 latents) is widened *there* by the field's kind
    (:meth:`shards.kinds.FieldKind.to_model`: PCM scaled by 1/32768, ids and codes to int64, floats to
    float32; all exact), never on the host. Only a tensor in its field's storage dtype is widened:
    keys that are not fields (lengths, masks), and a model's own batch layout built by a loader
    transform (whose keys may look like field names, e.g. ``audio_input_ids``), are only moved;
    non-tensor entries (``keys``) pass through."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            f = registry.lookup(k)
            if f is not None and v.dtype == storage_dtype(f):
                v = f.kind.to_model(f, v)
        out[k] = v
    return out


def storage_dtype(field) -> torch.dtype:
    """The torch dtype ``field`` is stored (and batched with ``compact=True``) in."""
    return field.kind.host_dtype(field, compact=True)


class DevicePrefetcher:
    """Iterate ``batches`` with each batch already converted and on ``device`` (see the module docstring).

    Args:
        batches: an iterable of batch dicts (e.g. a :class:`loaders.ShardLoader`, or an endless
            stream of its epochs).
        device: the training device.
        convert: ``convert(batch, device) -> batch`` run on the side stream (default
            :func:`to_device`, which also widens compact fields on the device).
        state: called right after each batch is taken from ``batches`` (e.g. the loader's
            ``state_dict``); :attr:`state` holds its value for the batch last returned.
        ahead: take the next batch from ``batches`` when handing one out (default: on CUDA only,
            where it lets the copy overlap the step; on the CPU it only moves loader work earlier).
    """

    def __init__(self, batches: Iterable[dict[str, Any]], device: torch.device | str,
                 convert: Callable[[dict[str, Any], torch.device], dict[str, Any]] | None = None,
                 state: Callable[[], Any] | None = None, ahead: bool | None = None):
        self.device = torch.device(device)
        self.convert = convert or to_device
        self._state_fn = state
        self._next_state: Any = None
        self.state: Any = None
        self._it = iter(batches)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._ahead = self._cuda if ahead is None else bool(ahead)
        self._next: dict[str, Any] | None = None
        self._done = False

    def _load(self) -> None:
        try:
            batch = next(self._it)
        except StopIteration:
            self._next, self._done = None, True
            return
        if self._state_fn is not None:
            self._next_state = self._state_fn()
        if self._stream is None:
            self._next = self.convert(batch, self.device)
            return
        with torch.cuda.stream(self._stream):
            self._next = self.convert(batch, self.device)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._next is None and not self._done:
            self._load()
        if self._done and self._next is None:
            raise StopIteration
        batch, self.state = self._next, self._next_state
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    v.record_stream(current)
        self._next = None
        if self._ahead:
            self._load()  # batch k+1's copy starts now, while the caller computes on batch k
        return batch


__all__ = ["DevicePrefetcher", "to_device"]
