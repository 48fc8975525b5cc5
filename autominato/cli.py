"""The ``autominato`` command: one subcommand per module, loaded lazily.

Each subcommand's module provides ``add_arguments(parser)`` and ``run(args) -> int``, so
``autominato --help`` stays fast and a missing optional dependency only affects its command.

Exit status, the same for every command: 0 done; :data:`EXIT_FAILED` (1) the work ran and
failed (a case that did not prepare, a trial that crashed, a benchmark run that failed or
delivered wrong samples, a non-finite training loss; ``bench``'s goals are printed, not an
exit status); :data:`EXIT_USAGE`
(2) the command cannot start as written: a bad option or value (argparse's own status), or
an input that is missing or unreadable (a data folder, a configuration, an exporter's URL).
Options are never abbreviated (``--cost`` is not ``--cost-ms``), in any sub-command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

EXIT_FAILED = 1
EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviated options, for every sub-command
    (``add_subparsers`` makes sub-parsers of its parser's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def int_at_least(low: int) -> Callable[[str], int]:
    """An ``argparse`` type: a whole number ``>= low``.

    Raises (from the returned function):
        argparse.ArgumentTypeError: not a whole number, or below ``low`` (argparse turns it
            into ``error: argument --X: ...`` and exit status 2).
    """
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {n}")
        return n

    parse.__name__ = f"int_at_least_{low}"
    return parse


def port(text: str) -> int:
    """An ``argparse`` type: a TCP port, 0 (any free port) to 65535.

    Raises:
        argparse.ArgumentTypeError: not a whole number in that range.
    """
    n = int_at_least(0)(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free port), got {n}")
    return n


def seconds(text: str) -> float:
    """An ``argparse`` type: a finite duration >= 0, in seconds.

    Raises:
        argparse.ArgumentTypeError: not a number, negative, infinite or NaN.
    """
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return x


#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("autominato.train", "train a compact 3D-UNet fed by autominato.Loader (the main job)"),
    "prepare": ("autominato.data.prepare", "MLPerf 3D-UNet preprocessing of a KiTS19 folder"),
    "tune": ("autominato.tune", "offline Optuna search of loader settings minimising GPU idle time"),
    "bench": ("autominato.bench", "side-by-side benchmark against other loaders"),
    "monitor": ("autominato.telemetry.remote", "print the Data Monitor report of a running exporter"),
    "dashboards": ("autominato.telemetry.grafana", "generate or push the Grafana dashboard"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="autominato", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        # Import only the module of the command being run: the others may need extras.
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
