"""The scenarios: end-to-end studies built from the packages below them, each a module with
``run(...)`` (rows, files, plots) and ``main(argv)`` (its command line, also
``python scenarios/<name>.py``).

* :mod:`qlink.scenarios.qec_memory`: logical error rate against p and d, decoded over a transport;
* :mod:`qlink.scenarios.realtime_loop`: the real-time loop against the cycle and a deadline;
* :mod:`qlink.scenarios.kv_disagg`: disaggregated prefill -> decode, KV moved between processes;
* :mod:`qlink.scenarios.fabric_scale`: many controllers and decoders on a modeled fabric.

>>> from qlink.scenarios import qec_memory
>>> qec_memory.CSV_NAME
'qec_memory.csv'
"""
