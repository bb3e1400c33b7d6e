"""``python scenarios/realtime_loop.py --help``: the real-time QEC loop against the surface-code cycle and a decoder deadline.

The scenario itself is :mod:`qlink.scenarios.realtime_loop` (importable, as the paper build and
``qlink run`` use it); this script is its command line.
"""

import sys

if __name__ == "__main__":
    from qlink._argparse import run_main
    from qlink.scenarios.realtime_loop import main

    sys.exit(run_main(main))
