"""The command line's argument parser: argparse's, naming the closest option when it
meets one it does not know (``--fail-on-misses``: did you mean ``--fail-on-miss``?)."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

__all__ = ["SuggestingParser"]

_UNRECOGNIZED = "unrecognized arguments: "


class SuggestingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose "unrecognized arguments" error names, for each unknown
    option, the closest option of this command or of its sub-commands (their parsers
    are of this class too: ``add_subparsers`` makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            hints = []
            for arg in message.removeprefix(_UNRECOGNIZED).split():
                flag = arg.partition("=")[0]
                if not flag.startswith("-"):
                    continue
                close = difflib.get_close_matches(flag, self._options(), n=1, cutoff=0.6)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
            if hints:
                message = f"{message} ({'; '.join(hints)})"
        super().error(message)

    def _options(self) -> list[str]:
        found: list[str] = []
        parsers: list[argparse.ArgumentParser] = [self]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                found.extend(action.option_strings)
                if isinstance(action, argparse._SubParsersAction):
                    parsers.extend(action.choices.values())
        return found
