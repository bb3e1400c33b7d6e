"""``python scenarios/qec_memory.py --help``: logical error rate against physical error rate and distance, decoded over a transport.

The scenario itself is :mod:`qlink.scenarios.qec_memory` (importable, as the paper build and
``qlink run`` use it); this script is its command line.
"""

import sys

if __name__ == "__main__":
    from qlink._argparse import run_main
    from qlink.scenarios.qec_memory import main

    sys.exit(run_main(main))
