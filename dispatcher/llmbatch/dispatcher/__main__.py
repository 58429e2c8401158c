"""``python -m llmbatch.dispatcher``: the same as ``llmbatch dispatcher run``."""

from __future__ import annotations

import sys

from llmbatch.dispatcher.cli import app

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "run", *sys.argv[1:]]
    app()
