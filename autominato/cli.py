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

EXIT_FAILED = 1
EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviated options, for every sub-command
    (``add_subparsers`` makes sub-parsers of its parser's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


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
