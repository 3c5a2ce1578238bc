"""``python -m engine --model PATH ...``: serve one model over the OpenAI API."""

import os
import sys

from engine.model.cpu.openmp_env import configure

configure(sys.argv[1:], os.environ)  # before torch loads (see engine.model.cpu.openmp_env)

from engine.serving.cli import main  # noqa: E402

sys.exit(main())
