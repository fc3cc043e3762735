"""The argument parser of every command: a usage error is one line, not the whole usage."""

from __future__ import annotations

import argparse
import os
import re
from typing import NoReturn

from dlrover_hpc import settings


class Parser(argparse.ArgumentParser):
    """``PROG: error: what is wrong; see 'PROG --help'`` on stderr, exit 2.

    Exit codes: docs/design/architecture.md section 4.

    Sub-command parsers are made with the parser's own class, so they answer the same way.
    """

    def error(self, message: str) -> NoReturn:
        hint = self._default_hint(message) or _env_hint(message)
        self.exit(2, f"{self.prog}: error: {message}{hint}; see '{self.prog} --help'\n")

    def _default_hint(self, message: str) -> str:
        """A bad value that came from a flag's default: name the variable or the file and line
        that set it (the ``origins`` default of a parser built with ``site_config.Defaults``)."""
        match = re.match(r"argument ([\w-]+)", message)
        origins = self.get_default("origins")
        action = self._option_string_actions.get(match.group(1)) if match else None
        origin = origins.get(action.dest) if origins and action else None
        if origin is None or not origin.hint() or f"'{origin.value}'" not in message:
            return ""
        return f" ({origin.hint()})"


def _env_hint(message: str) -> str:
    """A bad value that came from a flag's variable (flag defaults): name the variable."""
    match = re.match(r"argument --([\w-]+)", message)
    if not match:
        return ""
    name = settings.PREFIX + match.group(1).replace("-", "_").upper()
    value = os.environ.get(name)
    return f" (from {name}={value})" if value is not None and f"'{value}'" in message else ""
