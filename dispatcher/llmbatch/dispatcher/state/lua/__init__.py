"""The dispatcher's Redis Lua scripts, one file per operation, each with a header naming its KEYS and
ARGV; every key a script touches is declared in KEYS (tests/integration/test_store_declared_keys.py
watches them on a real Redis). :func:`load` reads one."""

from __future__ import annotations

from importlib import resources

_WITH_COMMON = frozenset({"intake", "transition", "mark_published", "mark_dlt_written", "drop_orphans"})


SHEBANG = "#!lua\n"


def load(name: str) -> str:
    """The text of ``<name>.lua``, with ``common.lua``'s helpers in front when it uses them (after its
    ``#!lua`` line, which must stay first)."""
    here = resources.files(__name__)
    body = here.joinpath(f"{name}.lua").read_text()
    if name not in _WITH_COMMON:
        return body
    shebang = SHEBANG if body.startswith(SHEBANG) else ""
    return shebang + here.joinpath("common.lua").read_text() + body.removeprefix(shebang)
