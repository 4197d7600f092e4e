"""``python -m tl_core.cli`` runs the ``tl`` command."""

import sys

from tl_core.cli import main

sys.exit(main())
