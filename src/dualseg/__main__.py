"""``python -m dualseg`` (also what ``torchrun -m dualseg train ...`` runs)."""

import sys

from dualseg.cli import main

sys.exit(main())
