"""``python -m llmbatch.ray_job --spec-b64 ...``: run one attempt of one batch (see
:mod:`llmbatch.ray_job`)."""

import os
import sys

from llmbatch.ray_job.job.main import main

if __name__ == "__main__":  # vLLM may spawn processes that re-import __main__: keep the guard
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # results, manifest and progress are written by now: skip Ray's slow interpreter teardown
    # (the job's actors are reclaimed by Ray when the driver exits)
    os._exit(code)
