"""Small helpers shared by the two command-line programs."""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps paragraphs in descriptions and epilogs, and shows defaults where they are set."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" not in text and action.default not in (None, False, argparse.SUPPRESS):
            if action.option_strings:
                text += " (default: %(default)s)"
        return text


def not_implemented(name: str) -> int:
    """Report a subcommand that exists in the interface but is not built yet."""
    print(f"{name}: not implemented yet", file=sys.stderr)
    return EXIT_USAGE
