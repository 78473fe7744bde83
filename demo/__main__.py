"""``python -m demo``: see :mod:`demo.cli`."""

from demo.cli import main

if __name__ == "__main__":
    main()
