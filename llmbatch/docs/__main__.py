"""``python -m llmbatch.docs``: see :mod:`llmbatch.docs`."""

import sys

from llmbatch.docs import main

sys.exit(main())
