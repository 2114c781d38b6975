"""Render sbatch scripts from Jinja2 templates with every printed value shell-quoted by default.

The templates (``bufreuse.slurm``: ``proxy.sbatch.j2``, ``megatron.sbatch.j2``, or a user's own
file) are bash scripts. Jinja's ``finalize`` hook runs on every ``{{ ... }}`` output, so this
environment quotes each value with :func:`shlex.quote` unless a filter marked it :class:`ShellSafe`:

- ``{{ value }}`` — shell-quoted (a list becomes space-separated quoted words);
- ``{{ value | sbatch }}`` — for ``#SBATCH`` lines, which sbatch parses itself (no shell): the value
  is checked to be one line, and double-quoted if it holds spaces;
- ``{{ value | q }}`` — explicit quoting (same as the default, for readability).

Nothing prints a value raw, so a partition such as ``x;touch /tmp/pwned`` can at worst become a
quoted word. Undefined names raise (``StrictUndefined``) instead of rendering as empty. Rendering
costs well under a millisecond per script.
"""

from __future__ import annotations

import importlib.resources
import shlex
from pathlib import Path
from typing import Any

import jinja2

from bufreuse.errors import InputError
from bufreuse.launch.site import check_single_line

__all__ = ["BUILTIN_TEMPLATES", "ShellSafe", "load_template", "make_environment", "render_script", "shell_quote"]

BUILTIN_TEMPLATES = {"proxy": "proxy.sbatch.j2", "megatron": "megatron.sbatch.j2"}
"""Template names users can pass to ``--template`` instead of a path."""


class ShellSafe(str):
    """A string already safe to paste into a bash script (quoted or validated by a filter)."""

    __slots__ = ()


def shell_quote(value: Any) -> ShellSafe:
    """Quote one value (or each item of a list/tuple) for bash; refuses NUL and None."""
    if isinstance(value, ShellSafe):
        return value
    if value is None:
        raise InputError("template printed None: guard optional values with {% if ... %}")
    if isinstance(value, list | tuple):
        return ShellSafe(" ".join(shell_quote(v) for v in value))
    if isinstance(value, bool):
        return ShellSafe("true" if value else "false")
    if isinstance(value, int | float):
        return ShellSafe(str(value))
    text = str(value)
    if "\x00" in text:
        raise InputError(f"value {text!r} contains a NUL byte")
    return ShellSafe(shlex.quote(text))


def _sbatch_value(value: Any) -> ShellSafe:
    if isinstance(value, bool) or value is None:
        raise InputError(f"#SBATCH value must be a string or number, got {value!r}")
    text = check_single_line("#SBATCH value", str(value))
    if any(c.isspace() for c in text):
        if '"' in text:
            raise InputError(f"#SBATCH value {text!r} holds both spaces and a double quote")
        name, sep, rest = text.partition("=")
        plain_name = sep and name.startswith("-") and not any(c.isspace() for c in name)
        text = f'{name}="{rest}"' if plain_name else f'"{text}"'
    return ShellSafe(text)


def make_environment() -> jinja2.Environment:
    """The Jinja2 environment every sbatch template renders in (shell-quoting ``finalize``)."""
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        finalize=shell_quote,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch"] = _sbatch_value
    return env


def load_template(template: str | Path) -> tuple[str, str]:
    """Return ``(source, origin)`` for a builtin template name or a path to the user's own file."""
    name = str(template)
    if name in BUILTIN_TEMPLATES:
        resource = importlib.resources.files("bufreuse.slurm").joinpath(BUILTIN_TEMPLATES[name])
        return resource.read_text(encoding="utf-8"), f"bufreuse.slurm/{BUILTIN_TEMPLATES[name]}"
    path = Path(template)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except UnicodeDecodeError:
        raise InputError(f"--template {name!r}: not UTF-8 text; an sbatch template (Jinja2) expected") from None
    except OSError as e:
        raise InputError(
            f"--template {name!r}: cannot read ({e.strerror or e}); use a file path or one of "
            f"{', '.join(sorted(BUILTIN_TEMPLATES))}"
        ) from None


def render_script(source: str, context: dict[str, Any], *, origin: str = "<template>") -> str:
    """Render one sbatch script; template errors become :class:`InputError` naming ``origin``."""
    env = make_environment()
    try:
        text = env.from_string(source).render(**context)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{origin}:{e.lineno}: template syntax error: {e.message}") from None
    except jinja2.UndefinedError as e:
        raise InputError(f"{origin}: {e.message} (see docs/slurm.md for the names a template can use)") from None
    if not text.startswith("#!"):
        raise InputError(f"{origin}: an sbatch script must start with a '#!' line")
    return text
