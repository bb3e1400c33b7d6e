"""Reliability harnesses: what qlink does when things go wrong, measured, not assumed.

Not benchmarks (those live in :mod:`qlink.bench`): each harness here injects a fault,
kills a peer, feeds malformed bytes, or holds a load for a long time, and checks that
every message is accounted for and every failure is typed and counted.

* :mod:`qlink.reliability.faults`: faults injected on a link (drop, duplicate, delay,
  corrupt...) through ``emulated+`` URLs, each detected and counted (``fault matrix``);
* :mod:`qlink.reliability.crash`: a decoder service or KV peer killed with SIGKILL at
  chosen points, the survivor's typed error and its time to notice;
* :mod:`qlink.reliability.fuzz`: mutation and coverage-guided (atheris) fuzzing of every
  parser that reads peer bytes; ``python -m qlink.reliability.fuzz TARGET``;
* :mod:`qlink.reliability.soak`: sustained load with nothing lost, memory flat and
  nothing leaked; ``qlink bench soak`` runs all four and writes ``soak.json``/``.csv``.

>>> import qlink.reliability.fuzz as fuzz
>>> "wire_request" in fuzz.TARGETS
True
"""
