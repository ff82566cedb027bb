"""`python -m specwire ...` is the `specwire` command."""

import sys

from specwire.common.cli import main

sys.exit(main())
