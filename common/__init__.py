"""What the gateway and the engine share, and nothing heavier: the hardened HTTP server both run
(connection limits, client deadlines, parser refusals as JSON), request bodies (size limits that
hold after decompression, strict JSON), the error they raise for a refused request, and a
process as /proc shows it (also for the scripts and tests). Imports no torch and nothing from
gateway/ or engine/."""
