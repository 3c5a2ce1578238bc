"""``python -m engine.template --socket-fd N [--spin-wait] --cmdline-room ROOM``: an engine
template for engines of one OpenMP wait policy, serving the gateway's fork requests on the
inherited socket N until the gateway closes it."""

import argparse
import os
import sys

from common.engine_args import SPIN_WAIT_FLAG
from common.template_wire import CMDLINE_ROOM_FLAG, SOCKET_FD_FLAG, TEMPLATE_MODULE
from engine.gpu_presence import decline_triton_without_gpu
from engine.model.cpu.openmp_env import configure


def _options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {TEMPLATE_MODULE}")
    parser.add_argument(SOCKET_FD_FLAG, type=int, required=True, dest="socket_fd")
    parser.add_argument(SPIN_WAIT_FLAG, action="store_true", dest="spin_wait")
    parser.add_argument(CMDLINE_ROOM_FLAG, default="", dest="room")  # only its length matters
    return parser.parse_args(argv)


options = _options(sys.argv[1:])
# Before torch loads: libgomp reads the wait policy once, and every engine forked from here
# inherits what it read (one template per policy).
configure([SPIN_WAIT_FLAG] if options.spin_wait else [], os.environ)
decline_triton_without_gpu(os.environ)

from engine.template.preload import preload  # noqa: E402

preloaded = preload()  # first: the server's imports (the engine's loader ...) are on its list
from engine.template.server import TemplateServer  # noqa: E402
from engine.template.tokenizers import TokenizerShelf  # noqa: E402

code = TemplateServer(options.socket_fd, preloaded, TokenizerShelf()).run()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # no interpreter teardown: nothing of it is needed, and some extensions complain
