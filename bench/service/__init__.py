"""The parts of ``bench/bench_service.py`` (the benchmark through the real service), one job each.

- :mod:`.options`: the command line (``--skip``, ``--background``, ``--quick``, ...) and its checks.
- :mod:`.common`: what every part shares: :class:`~.common.BenchError`, a submitted batch, ``say``.
- :mod:`.ledger`: what the run records as it goes: the results topic's events, the load average.
- :mod:`.harness`: the stack, the dispatcher process and the producer client of one run (:class:`Service`).
- :mod:`.scheduling`: the ``--background`` experiment: CPU scheduling and core pinning of the run.
- :mod:`.cpu`: cores used and context switches of every process of the machine during a phase.
- :mod:`.workload`: the phases (warm-up, A/B, warm, throughput, fairness) and their figures.
- :mod:`.plain`: the plain ``vllm.LLM.chat`` baseline in a fresh process.
- :mod:`.report`: the machine's header, the figures against their targets, the printed summary.
"""
