"""``python -m dualseg`` (also what ``torchrun -m dualseg train ...`` runs)."""

import sys

from dualseg.cli import main

if __name__ == "__main__":  # spawn-based worker processes re-import this module
    sys.exit(main())
