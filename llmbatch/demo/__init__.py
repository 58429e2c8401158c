"""The demo (``make demo``, ``python -m llmbatch.demo``): :mod:`llmbatch.demo.run` starts the local
stack and runs a real batch end to end; :mod:`llmbatch.demo.batch` is its input, checked;
:mod:`llmbatch.demo.report` prints what came back."""
