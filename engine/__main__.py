"""``python -m engine --model PATH ...``: serve one model over the OpenAI API."""

import sys

from engine.cli import main

sys.exit(main())
