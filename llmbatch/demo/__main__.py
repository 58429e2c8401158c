"""``python -m llmbatch.demo``: see :mod:`llmbatch.demo.run`."""

import sys

from llmbatch.demo.run import main

sys.exit(main())
