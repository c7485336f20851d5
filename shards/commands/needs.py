"""What a ``shards`` command needs beyond the core install, declared where the command is registered.

The core (``pip install shardcache``: what a training node installs) runs every ``shards`` command that
reads a cache with numpy and pyarrow alone (``info``, ``ls``, ``head``, ``show``, ``verify``,
``rejects``...). A command that needs more declares it with ``p.set_defaults(needs=Needs(...))``
(``query`` and ``stats``: DuckDB; ``export-audio``: soundfile; ``reindex``: joblib...), and imports those
modules only when it runs. :func:`shards.cli.main` checks the declaration before the command runs and,
for a module that cannot be imported, exits 2 naming it and the install that brings it (``pip install
"shardcache[inspect]"``), in the core install and in a full install that lacks it alike: never a
traceback. Code that needs a module on one path only (``stats --plot``: matplotlib) calls
:func:`require` there.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


class MissingModule(Exception):
    """A module a command declared is not importable: exit code 2, the message names the install."""


@dataclass(frozen=True)
class Needs:
    """Modules a command imports beyond the core, and the extra of ``pyproject.toml`` that brings them.

    Attributes:
        modules: top-level module names (``"duckdb"``).
        extra: the ``shardcache`` extra that installs them (``"inspect"``), or None when none does (then
            the hint is ``pip install MODULE``).
    """

    modules: tuple[str, ...] = ()
    extra: str | None = None

    def install_hint(self) -> str:
        """The command that installs what is missing: ``pip install "shardcache[EXTRA]"``."""
        return f'pip install "shardcache[{self.extra}]"' if self.extra else "pip install " + " ".join(self.modules)


#: what ``query`` and ``stats`` need (``stats --plot`` also :data:`PLOT`)
DUCKDB = Needs(("duckdb",), "inspect")
PLOT = Needs(("matplotlib",), "inspect")
#: what ``view`` needs: Jinja2 (HTML templates with autoescape), DuckDB (the filter's SQL condition),
#: matplotlib (codes and latents as images), Pillow (source images and thumbnails); the text tokenizer's
#: ``tokenizers`` is optional (without it token ids are shown, saying so)
VIEWER = Needs(("jinja2", "duckdb", "matplotlib", "PIL"), "inspect")


def missing(needs: Needs) -> list[str]:
    """The modules of ``needs`` that are not installed here (``importlib.util.find_spec``: found, not
    imported, so a command pays for a module only where it uses it; one that is found but fails to
    import is named by :func:`from_import_error` when the command imports it)."""
    out = []
    for name in needs.modules:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except (ImportError, ValueError):
            out.append(name)
    return out


def require(needs: Needs, what: str = "this command") -> None:
    """Raise :class:`MissingModule` naming the modules of ``needs`` that are not importable, ``what``
    needs them for, and the install that brings them."""
    absent = missing(needs)
    if absent:
        raise MissingModule(f"{what} needs {', '.join(absent)}, which this install does not have: "
                            f"{needs.install_hint()}")


def from_import_error(e: ModuleNotFoundError, needs: Needs) -> MissingModule:
    """The :class:`MissingModule` for a module found missing while the command ran: named with the
    install of ``needs`` when it declared the module, else as a module to install."""
    name = (e.name or "").split(".")[0] or str(e)
    hint = needs.install_hint() if name in needs.modules else f"pip install {name}"
    return MissingModule(f"this command needs {name}, which this install does not have: {hint}")
