"""``python -m mcore_rl ...``: the ``mcore-rl`` command, for environments where the package is on
``PYTHONPATH`` but not installed (no console script), such as a container with a mounted checkout."""

import sys

from mcore_rl.cli import main

sys.exit(main())
