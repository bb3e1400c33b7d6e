"""``python scenarios/fabric_scale.py --help``: a fleet of controllers and decoders on a modeled fabric.

The scenario itself is :mod:`qlink.scenarios.fabric_scale` (importable, as the paper build and
``qlink run`` use it); this script is its command line.
"""

import sys

if __name__ == "__main__":
    from qlink._argparse import run_main
    from qlink.scenarios.fabric_scale import main

    sys.exit(run_main(main))
