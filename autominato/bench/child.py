"""One benchmark run in a fresh process: ``python -m autominato.bench.child SPEC OUT``.

``SPEC`` is a cloudpickled :class:`~autominato.bench.runner.RunSpec`; the figures (or
``{"error": ..., "traceback": ...}``) are written to ``OUT`` as JSON.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import cloudpickle


def main(argv: list[str]) -> int:
    from autominato.bench.runner import error_status, execute

    spec_path, out_path = Path(argv[0]), Path(argv[1])
    try:
        result = execute(cloudpickle.loads(spec_path.read_bytes()))
        rc = 0
    except Exception as e:
        result = {"error": error_status(e), "traceback": traceback.format_exc()}
        rc = 1
    out_path.write_text(json.dumps(result))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
