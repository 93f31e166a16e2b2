"""`python -m assistgen.cli`: the `assistgen` command."""

import sys

from assistgen.cli.main import main

sys.exit(main())
