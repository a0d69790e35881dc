"""``python -m chameleon_ft.cli ...`` is ``chameleon-ft ...``."""

import sys

from chameleon_ft.cli.main import main

sys.exit(main())
