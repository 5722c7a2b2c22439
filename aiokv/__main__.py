"""``python -m aiokv``: the command-line interface (same as the ``aiokv`` script)."""

from .cli import main

if __name__ == "__main__":
    main()
