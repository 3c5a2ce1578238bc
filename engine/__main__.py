"""``python -m engine --model PATH ...``: serve one model over the OpenAI API."""

import os
import sys
import time

_started = time.monotonic()

from engine import startup  # noqa: E402
from engine.gpu_presence import decline_triton_without_gpu  # noqa: E402
from engine.model.cpu.openmp_env import configure  # noqa: E402

configure(sys.argv[1:], os.environ)  # before torch loads (see engine.model.cpu.openmp_env)
decline_triton_without_gpu(os.environ)

from engine.serving.cli import main  # noqa: E402

startup.mark_process_start(_started)

sys.exit(main())
