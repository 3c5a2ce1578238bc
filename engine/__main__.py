"""``python -m engine --model PATH ...``: serve one model over the OpenAI API."""

import os
import sys

# Idle OpenMP threads sleep instead of spinning: engines share the machine's cores (several
# replicas, the gateway), and spinning workers made a contended 2-core decode step ~10x slower.
# It must be set before torch loads; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.cli import main

sys.exit(main())
