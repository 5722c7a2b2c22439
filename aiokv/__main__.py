"""``python -m aiokv``: the command-line interface (same as the ``aiokv`` script)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
