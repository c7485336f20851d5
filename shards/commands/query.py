"""``shards query``: filter the index with a small, safe expression language.

The expression is parsed with :func:`ast.parse` and only a whitelist of node types is turned into
a :class:`pyarrow.compute.Expression` (so the filter is pushed down into the Parquet read). Nothing
is ever evaluated as Python. Grammar::

    expr   := expr 'and' expr | expr 'or' expr | 'not' expr | '(' expr ')'
            | operand (CMP operand)+          # chains: 1 < duration_s <= 5
            | column 'in' '[' literal, ... ']' | column 'not in' '[' ... ']'
            | BOOL_COLUMN                       # has_image
    CMP    := '==' | '!=' | '<' | '<=' | '>' | '>='
    operand:= column | number | 'string' | True | False
"""
from __future__ import annotations

import argparse
import ast
import difflib
import textwrap
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ..index import INDEX_SCHEMA
from ._common import SCALAR_COLUMNS, Out, UsageError, cache_dir, index_path, read_index_columns

DEFAULT_COLUMNS = ("key", "shard", "duration_s", "n_frames", "has_image", "speaker")
MAX_QUERY_CHARS = 4000


def _kind(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    return "num"


#: column name -> "num" | "str" | "bool"
COLUMN_KINDS = {n: _kind(INDEX_SCHEMA.field(n).type) for n in SCALAR_COLUMNS}

_CMP_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_FORBIDDEN_NAMES = {
    ast.Call: "function calls", ast.Attribute: "attribute access", ast.BinOp: "arithmetic",
    ast.Subscript: "indexing", ast.Lambda: "lambdas", ast.IfExp: "if/else expressions",
    ast.NamedExpr: "assignments", ast.Is: "'is' (use ==)", ast.IsNot: "'is not' (use !=)",
}


class QueryError(UsageError):
    """The expression is not valid in the query language."""


class _Operand:
    def __init__(self, expr: pc.Expression, kind: str, column: str | None = None, text: str = ""):
        self.expr, self.kind, self.column, self.text = expr, kind, column, text


class _Compiler:
    def __init__(self, source: str):
        self.source = source
        self.columns: set[str] = set()

    def fail(self, node: ast.AST | None, message: str) -> QueryError:
        where = ""
        if node is not None and getattr(node, "col_offset", None) is not None:
            where = f" (at column {node.col_offset + 1})"
        return QueryError(f"invalid query {_short(self.source)}{where}: {message}")

    def _src(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.source, node) or type(node).__name__

    def condition(self, node: ast.AST) -> pc.Expression:
        """Compile ``node`` as a condition (a boolean expression)."""
        op = self.operand(node)
        if op.kind != "bool":
            hint = f" such as `{op.text} > 0`" if op.kind == "num" else f" such as `{op.text} == 'x'`"
            raise self.fail(node, f"`{op.text}` is not a condition; compare it{hint}")
        return op.expr

    def operand(self, node: ast.AST) -> _Operand:
        if isinstance(node, ast.BoolOp):
            exprs = [self.condition(v) for v in node.values]
            result = exprs[0]
            for e in exprs[1:]:
                result = (result & e) if isinstance(node.op, ast.And) else (result | e)
            return _Operand(result, "bool", text=self._src(node))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                return _Operand(~self.condition(node.operand), "bool", text=self._src(node))
            if isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
                value = self.literal(node.operand)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise self.fail(node, "unary minus applies to numbers only")
                value = -value if isinstance(node.op, ast.USub) else value
                return _Operand(pc.scalar(value), "num", text=self._src(node))
            raise self.fail(node, "only `not`, and `-` before a number, are allowed")
        if isinstance(node, ast.Compare):
            return _Operand(self.compare(node), "bool", text=self._src(node))
        if isinstance(node, ast.Name):
            return self.column(node)
        if isinstance(node, ast.Constant):
            value = self.literal(node)
            kind = "bool" if isinstance(value, bool) else "str" if isinstance(value, str) else "num"
            return _Operand(pc.scalar(value), kind, text=repr(value))
        raise self.unsupported(node)

    def unsupported(self, node: ast.AST) -> QueryError:
        what = _FORBIDDEN_NAMES.get(type(node), f"{type(node).__name__} nodes")
        return self.fail(node, f"not allowed in a query: {what}; use comparisons "
                               "(== != < <= > >=), `in [...]`, and/or/not and parentheses over "
                               "index columns")

    def column(self, node: ast.Name) -> _Operand:
        name = node.id
        if name in ("true", "false"):
            return _Operand(pc.scalar(name == "true"), "bool", text=name)
        if name not in COLUMN_KINDS:
            close = difflib.get_close_matches(name, COLUMN_KINDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            if name == "members":
                hint = "members is a nested column and cannot be queried; "
            raise self.fail(node, f"unknown column {name!r}; {hint}columns: {', '.join(COLUMN_KINDS)}"
                                  " (quote strings: speaker == 'alice')")
        self.columns.add(name)
        return _Operand(pc.field(name), COLUMN_KINDS[name], column=name, text=name)

    def literal(self, node: ast.AST) -> Any:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.literal(node.operand)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.fail(node, "unary minus applies to numbers only")
            return -value if isinstance(node.op, ast.USub) else value
        if not isinstance(node, ast.Constant):
            raise self.fail(node, f"expected a literal (number, 'string', True/False), got "
                                  f"`{self._src(node)}`")
        value = node.value
        if isinstance(value, (bool, int, float, str)):
            return value
        raise self.fail(node, f"{type(value).__name__} literals are not supported")

    def compare(self, node: ast.Compare) -> pc.Expression:
        result = None
        left_node = node.left
        left = self.operand(left_node)
        for op, right_node in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)):
                if left.column is None:
                    raise self.fail(left_node, "the left side of `in` must be a column")
                if not isinstance(right_node, (ast.List, ast.Tuple, ast.Set)):
                    raise self.fail(right_node, "`in` needs a list of literals: key in ['a', 'b']")
                values = [self.literal(e) for e in right_node.elts]
                for v in values:
                    self.check_kinds(node, left, _Operand(pc.scalar(v), _value_kind(v), text=repr(v)))
                # numbers: let Arrow infer int64/float64 (casting 1.5 to an int column would truncate)
                value_type = pa.float64() if left.kind == "num" and any(
                    isinstance(v, float) for v in values) else (
                    pa.int64() if left.kind == "num" else INDEX_SCHEMA.field(left.column).type)
                expr = left.expr.isin(pa.array(values, type=value_type))
                if isinstance(op, ast.NotIn):
                    expr = ~expr
                right = None
            elif type(op) in _CMP_OPS:
                right = self.operand(right_node)
                self.check_kinds(node, left, right)
                if left.column is None and right.column is None:
                    raise self.fail(node, f"`{self._src(node)}` compares two constants; name a column")
                if left.kind == "bool" and type(op) not in (ast.Eq, ast.NotEq):
                    raise self.fail(node, "booleans can only be compared with == or !=")
                expr = _apply(type(op), left.expr, right.expr)
            else:
                raise self.unsupported(op)
            result = expr if result is None else (result & expr)
            if right is None:
                if op is not node.ops[-1]:
                    raise self.fail(node, "`in` cannot be chained with other comparisons")
                break
            left_node, left = right_node, right
        return result

    def check_kinds(self, node: ast.AST, a: _Operand, b: _Operand) -> None:
        if a.kind != b.kind:
            raise self.fail(node, f"cannot compare `{a.text}` ({_KIND_WORDS[a.kind]}) with "
                                  f"`{b.text}` ({_KIND_WORDS[b.kind]})")


_KIND_WORDS = {"num": "a number", "str": "a string", "bool": "a boolean"}


def _value_kind(v: Any) -> str:
    return "bool" if isinstance(v, bool) else "str" if isinstance(v, str) else "num"


def _apply(op: type, a: pc.Expression, b: pc.Expression) -> pc.Expression:
    if op is ast.Eq:
        return a == b
    if op is ast.NotEq:
        return a != b
    if op is ast.Lt:
        return a < b
    if op is ast.LtE:
        return a <= b
    if op is ast.Gt:
        return a > b
    return a >= b


def _short(source: str, limit: int = 80) -> str:
    return repr(source if len(source) <= limit else source[:limit] + "...")


def compile_query(text: str) -> tuple[pc.Expression, set[str]]:
    """Compile a query into ``(pyarrow expression, columns it reads)``; :class:`QueryError` if invalid."""
    source = text.strip()
    if not source:
        raise QueryError("empty query; e.g. \"duration_s > 5 and has_image\"")
    if len(source) > MAX_QUERY_CHARS:
        raise QueryError(f"query longer than {MAX_QUERY_CHARS} characters")
    source = " ".join(source.splitlines())
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as e:
        col = f" at column {e.offset}" if e.offset else ""
        raise QueryError(f"cannot parse {_short(source)}{col}: {e.msg}. Use ==, !=, <, <=, >, >=, "
                         "and, or, not, parentheses and quoted 'strings'") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise QueryError(f"cannot parse {_short(source)}: {type(e).__name__}") from None
    compiler = _Compiler(source)
    try:
        expr = compiler.condition(tree.body)
    except RecursionError:
        raise QueryError("query nested too deeply") from None
    return expr, compiler.columns


# ------------------------------------------------------------------------------------- command

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "query", parents=[common], help="filter the index with an expression",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print the index rows matching an expression over index columns.\n\n"
                    + textwrap.fill(", ".join(f"{c} ({COLUMN_KINDS[c]})" for c in SCALAR_COLUMNS),
                                    width=78, initial_indent="columns: ", subsequent_indent=" " * 9)
                    + "\n"
                    "syntax:  comparisons == != < <= > >= (chains like 1 < duration_s < 5),\n"
                    "         and / or / not, parentheses, 'quoted strings', True / False,\n"
                    "         col in ['a', 'b'], col not in [...]; a boolean column alone\n"
                    "         (has_image) is a condition. Nothing is evaluated as Python.",
        epilog="examples:\n"
               "  shards query cache/ \"duration_s > 5 and has_image\"\n"
               "  shards query cache/ \"speaker == 'alice' or (n_frames >= 100 and not has_image)\"\n"
               "  shards query cache/ \"sample_rate in [16000, 24000]\" --count\n"
               "  shards query cache/ \"has_image\" --sort duration_s --desc --limit 10")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("expression", metavar="EXPR", help="filter expression (quote it)")
    p.add_argument("--count", action="store_true", help="print only the number of matching rows")
    p.add_argument("--columns", metavar="COLS", default=",".join(DEFAULT_COLUMNS),
                   help="comma-separated columns to print (default: %(default)s)")
    p.add_argument("--sort", metavar="COL", help="sort the rows by this column")
    p.add_argument("--desc", action="store_true", help="with --sort: largest first")
    p.add_argument("--limit", type=int, metavar="N", help="print at most N rows")
    p.set_defaults(func=cmd_query)


def cmd_query(args: argparse.Namespace) -> int:
    out = Out(args)
    d = cache_dir(args.dir)
    expr, _ = compile_query(args.expression)
    if args.count:
        n = ds.dataset(index_path(d), format="parquet", schema=INDEX_SCHEMA).count_rows(filter=expr)
        if out.json:
            out.emit_json(dict(count=n))
        else:
            out.line(str(n))
        return 0
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    bad = [c for c in columns if c not in SCALAR_COLUMNS]
    if bad or not columns:
        raise UsageError(f"--columns: unknown column(s) {', '.join(bad) or '(none given)'}; "
                         f"columns: {', '.join(SCALAR_COLUMNS)}")
    sort_col = None
    if args.sort:
        sort_col = args.sort
        if sort_col not in SCALAR_COLUMNS:
            raise UsageError(f"--sort: unknown column {sort_col!r}; columns: {', '.join(SCALAR_COLUMNS)}")
    if args.limit is not None and args.limit < 0:
        raise UsageError("--limit must be >= 0")
    read = list(dict.fromkeys(columns + ([sort_col] if sort_col else [])))
    table = read_index_columns(d, read, filter=expr)
    total = table.num_rows
    if sort_col:
        table = table.sort_by([(sort_col, "descending" if args.desc else "ascending")])
    if args.limit is not None:
        table = table.slice(0, args.limit)
    table = table.select(columns)
    if out.json:
        out.emit_json(dict(count=total, rows=table.to_pylist()))
        return 0
    rows = zip(*(table.column(c).to_pylist() for c in columns)) if table.num_rows else []
    caption = f"{total} matching row(s)" + (f", showing {table.num_rows}" if table.num_rows < total else "")
    out.table(columns, rows, caption=caption if out.rich else None)
    return 0
