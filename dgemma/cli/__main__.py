"""`python -m dgemma.cli ...` (torchrun's form): the `dgemma` command."""

import sys

from . import main

sys.exit(main())
