"""The command line of ``python -m engine`` as the gateway uses it: the contract between the two
processes. engine/serving/cli.py defines these flags; tests/common/test_engine_args.py builds a
command here and parses it with the engine's own parser, so a renamed flag fails a test, not a
rollout."""

from __future__ import annotations

from dataclasses import dataclass

SPIN_WAIT_FLAG = "--spin-wait"


@dataclass(frozen=True)
class EngineArgs:
    """What the gateway's engine pool sets for one replica (``extra`` passes the rest through)."""

    model: str
    served_model_name: str
    port: int
    max_model_len: int
    max_num_seqs: int
    device: str
    host: str = "127.0.0.1"
    kv_cache_memory: int | None = None
    gpu_memory_fraction: float | None = None
    spin_wait: bool = False
    extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        args = [
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--device",
            self.device,
        ]
        if self.kv_cache_memory is not None:
            args += ["--kv-cache-memory", str(self.kv_cache_memory)]
        if self.gpu_memory_fraction is not None:
            args += ["--gpu-memory-fraction", str(self.gpu_memory_fraction)]
        if self.spin_wait:
            args.append(SPIN_WAIT_FLAG)
        return args + list(self.extra)
