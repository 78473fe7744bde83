"""``python -m checkpointing.cli``: the ``ckpt`` command."""

from checkpointing.cli import main

if __name__ == "__main__":
    main()
