"""``python -m disco_jax.cli`` runs the ``disco`` command line."""

import sys

from disco_jax.cli import main

sys.exit(main())
