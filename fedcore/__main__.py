"""``python -m fedcore``: the same as the ``fedcore`` command."""

from fedcore.cli import main

if __name__ == "__main__":
    main()
