"""``python -m autominato ...`` runs the ``autominato`` command."""

import sys

from autominato.cli import main

sys.exit(main())
