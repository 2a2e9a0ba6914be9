"""``specdec`` command line. Each subcommand lives in ``specdec/commands/<name>.py`` and exposes
``register(subparsers)``; errors specdec raises on purpose print as one line with exit code 2."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import specdec.commands as commands_pkg
from specdec.errors import SpecdecError


def command_names() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.iter_modules(commands_pkg.__path__)
        if not info.name.startswith("_") and info.name != "common"
    )


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with ``only`` that one (what it imports is all that loads)."""
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for Hugging Face LLMs.")
    from specdec import __version__

    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in command_names():
        if only is None or name == only:
            importlib.import_module(f"specdec.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    # `specdec diagnose ...` needs only its own module: the model commands' imports (torch) stay unloaded.
    parser = build_parser(argv[0] if argv and argv[0] in command_names() else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "loads_models", True):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
        return int(args.func(args) or 0)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
