"""``python -m stateshift.cli``: the ``stateshift`` command."""

import sys

from . import main

sys.exit(main())
