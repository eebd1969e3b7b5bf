"""``python -m stateshift``: the same as the ``stateshift`` command."""

import sys

from .cli import main

sys.exit(main())
