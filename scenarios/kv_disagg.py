"""``python scenarios/kv_disagg.py --help``: disaggregated prefill -> decode serving, KV blocks moved between two processes.

The scenario itself is :mod:`qlink.scenarios.kv_disagg` (importable, as the paper build and
``qlink run`` use it); this script is its command line.
"""

import sys

if __name__ == "__main__":
    import os

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from qlink._argparse import run_main
    from qlink.scenarios.kv_disagg import main

    sys.exit(run_main(main))
