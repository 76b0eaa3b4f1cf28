"""``python -m isojax.cli``: the ``isojax`` command."""

import sys

from isojax.cli import main

sys.exit(main())
