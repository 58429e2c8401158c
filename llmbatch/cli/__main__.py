"""``python -m llmbatch.cli``: the ``llmbatch`` command."""

from llmbatch.cli import main

main()
