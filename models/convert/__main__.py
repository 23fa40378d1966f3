"""``python -m models.convert``: see ``models.convert.cli``."""

import sys

from models.convert.cli import main

sys.exit(main())
