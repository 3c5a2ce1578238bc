"""Engine tests: the engine package in-process, and `python -m engine` as a subprocess."""
