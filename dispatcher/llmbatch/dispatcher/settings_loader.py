"""Loading the dispatcher's settings from the environment: an invalid environment is one line that names
the variable, the field inside it (a model of ``LLMBATCH_ENGINES__MODELS``, say), the problem and the fix.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from llmbatch.dispatcher.settings import ENGINES_ENV, ENGINES_EXAMPLE, DispatcherSettings
from llmbatch.schemas.errors import LLMBatchError

_ENTRY_FIELDS = '{"path", "engine", "resources", "scaling", "env_vars"}'
_NO_ECHO = frozenset({"missing", "value_error", "extra_forbidden", "assertion_error"})
_SCALAR = (str, int, float, bool)


class SettingsInvalid(LLMBatchError, ValueError):
    """The environment does not make valid dispatcher settings; ``str()`` is one line naming the
    variable, the field and the fix."""


def load_settings(**overrides: object) -> DispatcherSettings:
    """``DispatcherSettings()`` from the environment; raises :class:`SettingsInvalid` (one line)."""
    from pydantic_settings import SettingsError

    try:
        return DispatcherSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise SettingsInvalid(describe_settings_error(exc)) from None
    except SettingsError as exc:  # a value that is not JSON where an object or list is expected
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        raise SettingsInvalid(
            f"invalid settings: {exc}{cause}; objects and lists are JSON, "
            f"e.g. {ENGINES_ENV}='{ENGINES_EXAMPLE}'"
        ) from None


def describe_settings_error(exc: ValidationError, prefix: str = "LLMBATCH_") -> str:
    """One line for an invalid environment: the variable, the field inside it, the problem, the fix.

    ``LLMBATCH_ENGINES__MODELS`` is one JSON value, so for its errors the line names the model and the
    field of its entry (``model 'SmolLM2-135M-Instruct', field scaling``).
    """
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic never raises an empty ValidationError
        return f"invalid settings: {exc}"
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    env, inside = _env_var(loc, prefix)
    message = str(first["msg"]).removeprefix("Value error, ")
    if not loc:  # a rule across settings: its message names the variables
        return f"invalid settings: {message}"
    if first["type"] == "extra_forbidden":
        message = "unknown field (a typo?)"
    value = first.get("input")
    if first["type"] not in _NO_ECHO and isinstance(value, _SCALAR):
        message += f" (got {value!r:.60})"
    where = env
    if env == ENGINES_ENV and inside:
        model, rest = inside[0], [p for p in inside[1:] if p != "[key]"]
        if "[key]" in inside:
            where += f", model name {model!r}"
        else:
            where += f", model {model!r}" + (f", field {'.'.join(rest)}" if rest else "")
    elif inside:
        where += f" ({'.'.join(inside)})"
    line = f"invalid setting {where}: {message}"
    if env == ENGINES_ENV:
        line += f"; fix it in {ENGINES_ENV} (JSON: model name -> {_ENTRY_FIELDS})"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return line


def _env_var(loc: list[str], prefix: str) -> tuple[str, list[str]]:
    """The environment variable of a validation error's location, and the path inside its value
    (a dict or list setting is one JSON value)."""
    model: type[BaseModel] | None = DispatcherSettings
    names: list[str] = []
    for i, part in enumerate(loc):
        fields = model.model_fields if model is not None else {}
        if part not in fields:
            return prefix + "__".join(n.upper() for n in names), loc[i:]
        names.append(part)
        annotation = fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if model is None:
            return prefix + "__".join(n.upper() for n in names), loc[i + 1 :]
    return prefix + "__".join(n.upper() for n in names), []
