"""Filters on a cache's index: which rows a reader keeps (no tar is opened).

A filter is ``None`` (every row), a dict ``{column: condition}`` over :data:`FILTER_COLUMNS`, or a
callable on the index's scalar columns (see :func:`filter_rows`). A callable that reads only some
columns declares them by being a :class:`RowFilter` (``columns``): the index is then read for those
columns only (a cache of 10 million rows holds ~1 GB of key, speaker and sha256 strings that a
filter on the keys need not read).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .schema import INDEX_COLUMNS

#: index columns a filter may use (everything but the nested ``members`` column)
#: (derived: shards.schema.INDEX_COLUMNS, whose field columns come from the field registry)
FILTER_COLUMNS = tuple(c for c in INDEX_COLUMNS if c != "members")


class RowFilter:
    """A callable filter that declares the index columns it reads (``columns``, names of
    :data:`FILTER_COLUMNS`). Subclasses implement ``__call__(table) -> bool mask``."""

    columns: tuple[str, ...] = FILTER_COLUMNS

    def __call__(self, table: pa.Table) -> Any:  # pragma: no cover - the subclass's
        raise NotImplementedError


def columns_of(filters: Any) -> tuple[str, ...]:
    """The index columns :func:`filter_rows` reads for ``filters``: a dict's keys, a
    :class:`RowFilter`'s ``columns``, every scalar column for another callable, none for None.
    Raises ``ValueError`` naming an unknown column."""
    if filters is None:
        return ()
    if isinstance(filters, Mapping):
        cols: Sequence[str] = list(filters)
    elif isinstance(filters, RowFilter):
        cols = filters.columns
    else:
        cols = FILTER_COLUMNS
    bad = [c for c in cols if c not in FILTER_COLUMNS]
    if bad:
        raise ValueError(f"filter on unknown index column {bad[0]!r}; known: {', '.join(FILTER_COLUMNS)}")
    return tuple(dict.fromkeys(cols))


def _as_mask(result: Any, table: pa.Table) -> np.ndarray:
    if isinstance(result, pa.Table):
        if "key" not in result.column_names:
            raise TypeError("a filter returning a table must keep the 'key' column")
        return pc.is_in(table.column("key"), value_set=result.column("key").combine_chunks()).to_numpy(
            zero_copy_only=False)
    if isinstance(result, (pa.ChunkedArray, pa.Array)):
        result = result.to_numpy(zero_copy_only=False)
    mask = np.asarray(result)
    if mask.dtype != bool or mask.shape != (table.num_rows,):
        raise TypeError(f"a filter must return a bool mask of shape ({table.num_rows},) or a filtered "
                        f"table; got dtype {mask.dtype} shape {mask.shape}")
    return mask


def _column_mask(col: pa.ChunkedArray, name: str, cond: Any) -> np.ndarray:
    if callable(cond):
        return _as_mask(cond(col.to_numpy()), pa.table({name: col}))
    if isinstance(cond, tuple):
        if len(cond) != 2:
            raise ValueError(f"filter {name!r}: a tuple means (min, max); got {cond!r}")
        lo, hi = cond
        m = pc.and_(pc.greater_equal(col, lo) if lo is not None else pc.is_valid(col),
                    pc.less_equal(col, hi) if hi is not None else pc.is_valid(col))
    elif isinstance(cond, (list, set, frozenset, np.ndarray)):
        m = pc.is_in(col, value_set=pa.array(list(cond), type=col.type))
    else:
        m = pc.equal(col, pa.scalar(cond, type=col.type))
    return pc.fill_null(m, False).to_numpy(zero_copy_only=False)


def filter_rows(table: pa.Table, filters: Any = None) -> np.ndarray:
    """Row numbers (int64, ascending) of the index rows that pass ``filters``.

    ``filters`` is one of:

    * ``None``: every row;
    * a callable ``f(table) -> mask``: a bool mask ``(N,)`` (numpy or Arrow) or a filtered table
      (rows kept by ``key``), e.g. ``lambda t: pc.greater(t["n_frames"], 50)``;
    * a dict ``{column: condition}`` over :data:`FILTER_COLUMNS`, all conditions AND-ed:
      ``(min, max)`` closed interval (``None`` = unbounded), a list/set = one of, a scalar =
      equal, a callable = ``f(numpy column) -> mask``. Example:
      ``{"duration_s": (1.0, 20.0), "speaker": ["alice", "bob"], "has_image": True}``.

    Raises ``ValueError`` for an unknown column (listing the known ones) and ``TypeError`` for a
    filter of another kind. ``table`` needs only the columns :func:`columns_of` names.
    """
    n = table.num_rows
    if filters is None:
        return np.arange(n, dtype=np.int64)
    if callable(filters):
        mask = _as_mask(filters(table), table)
    elif isinstance(filters, Mapping):
        mask = np.ones(n, dtype=bool)
        for name, cond in filters.items():
            if name not in FILTER_COLUMNS:
                raise ValueError(f"filter on unknown index column {name!r}; known: {', '.join(FILTER_COLUMNS)}")
            mask &= _column_mask(table.column(name), name, cond)
    else:
        raise TypeError(f"filters must be None, a callable on the index table or a dict; got {type(filters)}")
    return np.flatnonzero(mask).astype(np.int64)




__all__ = ["FILTER_COLUMNS", "RowFilter", "columns_of", "filter_rows"]
