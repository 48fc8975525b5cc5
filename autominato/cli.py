"""The ``autominato`` command: one subcommand per module, loaded lazily.

Each subcommand's module provides ``add_arguments(parser)`` and ``run(args) -> int``, so
``autominato --help`` stays fast and a missing optional dependency only affects its command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

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
    parser = argparse.ArgumentParser(prog="autominato", description=__doc__.splitlines()[0])
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
