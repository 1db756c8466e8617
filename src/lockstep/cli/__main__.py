"""`python -m lockstep.cli`, the same as `lockstep`."""

import sys

from . import main

sys.exit(main())
