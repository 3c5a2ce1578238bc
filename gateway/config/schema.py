"""The typed, immutable configuration that models.yaml is read into, and the one place where every
default is written: the section readers take theirs from these dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from common.http_server import ClientLimits

MAX_GPU_FRACTION_SUM = 0.95  # the most every GPU replica's fraction may sum to (one card)
DEVICES = ("auto", "cpu", "cuda")
AFFINITY_KINDS = ("none", "prefix", "user")
RESIDENCY_KINDS = ("pinned", "on_demand")
ON_ERROR_POLICIES = ("allow", "deny", "local")  # gateway.state.on_error
# The variable holding the admin key in the shipped models.yaml (gateway.auth.admin_key_env), in
# a fleet from the command line, and where `modelyard ps` looks for it
ADMIN_KEY_ENV = "MODELYARD_ADMIN_KEY"
ADMISSION_POLICIES = ("fair", "fcfs")
# An external upstream's slots per backend when its models.yaml entry sets none: vLLM's default
# --max-num-seqs, the batch the most common upstream runs at once.
EXTERNAL_MAX_IN_FLIGHT = 256


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 2.0
    first_byte_s: float = 60.0  # to the response headers; for streams, to the first chunk
    idle_s: float = 30.0  # between stream chunks (and while reading a response body)
    total_s: float = 600.0


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 1


@dataclass(frozen=True)
class EjectionSettings:
    consecutive_failures: int = 3
    base_s: float = 5.0
    max_s: float = 300.0
    max_percent: float = 50.0


@dataclass(frozen=True)
class RetrySettings:
    attempts: int = 2  # total tries, the first included
    backoff_ms: float = 50.0
    budget_percent: float = 20.0  # retries may add at most this share of requests...
    budget_min: int = 10  # ...plus this reserve, so a quiet gateway can still retry


@dataclass(frozen=True)
class ApiKey:
    name: str
    key_env: str
    secret: str = field(repr=False)
    models: tuple[str, ...] | None  # None: every model
    rpm: int | None = None
    tpm: int | None = None
    # Admission (gateway/admission): the key's band (higher bands are served first), its share
    # of its model's tokens within the band, and whether it is refused first under overload.
    priority: int = 0
    weight: float = 1.0
    sheddable: bool = False


@dataclass(frozen=True)
class AuthSettings:
    admin_key_env: str | None = None
    admin_key: str | None = field(default=None, repr=False)
    keys: tuple[ApiKey, ...] = ()

    @property
    def open_mode(self) -> bool:
        return not self.keys


@dataclass(frozen=True)
class MemoryBudget:
    """What every resident engine may use together (``gateway.memory``): host memory in bytes
    (None: ``auto_cpu_share`` of the machine's RAM, read at start) and, per GPU, a fraction."""

    cpu_bytes: int | None = None
    auto_cpu_share: float = 0.75
    gpu_fraction: float = MAX_GPU_FRACTION_SUM
    park: bool = True  # evict by parking first; False: always stop (cold swaps, no parked floors)


@dataclass(frozen=True)
class SharedState:
    """``gateway.state``: the rate-limit buckets kept in one Redis that several gateways share,
    so that together they grant each allowance once (gateway/limits/)."""

    redis_url: str  # redis:// or rediss://, no password (password_env) and no query string
    password_env: str | None = None
    password: str | None = field(default=None, repr=False)
    key_prefix: str = "modelyard:"  # before every bucket key: fleets may share one Redis
    on_error: str = "local"  # one of ON_ERROR_POLICIES: what decides while Redis does not answer
    gateways: int = 1  # how many gateways share the limits: "local" grants 1/gateways each
    timeout_ms: float = 100.0  # connecting to Redis, and each answer

    @property
    def address(self) -> str:
        """The URL without its user info, for logs."""
        parts = urlsplit(self.redis_url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


@dataclass(frozen=True)
class AdmissionSettings:
    """``gateway.admission``: the order in which each model's line is served, unless the model
    sets its own."""

    policy: str = "fair"  # one of ADMISSION_POLICIES


@dataclass(frozen=True)
class EngineLogSettings:
    """``gateway.engine_logs``: each engine replica's output in a file of its own, rotated by size
    (gateway/engines/logs.py)."""

    dir: str | None = None  # None: <cache folder>/logs/<host>-<port> (one folder per gateway)
    max_bytes: int = 10 * 2**20  # a file this large is rotated
    files: int = 3  # kept per replica: the live file and files - 1 rotated ones (.1, .2, ...)


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    timeouts: Timeouts = Timeouts()
    health: HealthSettings = HealthSettings()
    ejection: EjectionSettings = EjectionSettings()
    retries: RetrySettings = RetrySettings()
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 8190
    clients: ClientLimits = field(default_factory=ClientLimits)
    access_log: bool = True
    watch_config: bool = True  # reload when models.yaml changes on disk
    # fork local engines from a process that has imported what they need (gateway/engines/
    # template.py): they start without seconds of imports and share its pages; false: exec each
    engine_template: bool = True
    engine_logs: EngineLogSettings = EngineLogSettings()
    auth: AuthSettings = AuthSettings()
    memory: MemoryBudget = MemoryBudget()
    state: SharedState | None = None  # None: every limit is this process's own
    admission: AdmissionSettings = AdmissionSettings()


@dataclass(frozen=True)
class ModelDefaults:
    """The ``defaults`` section: engine settings of local models that do not set their own."""

    device: str = "auto"  # one of DEVICES
    max_model_len: int = 4096
    max_num_seqs: int = 16
    gpu_memory_fraction: float | None = None
    kv_cache_memory: int | None = None


@dataclass(frozen=True)
class ModelLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None  # the model's slots over all its replicas (admission)


@dataclass(frozen=True)
class Affinity:
    by: str = "none"  # one of AFFINITY_KINDS
    prefix_chars: int = 256
    max_extra_load: int = 4  # leave the warm replica when it has this many more requests in flight


@dataclass(frozen=True)
class ModelAdmission:
    """``models[].admission``: the model's slots per available backend (None: derived, see
    ``ModelConfig.max_in_flight``) and the order its line is served in (the gateway's unless
    set)."""

    max_in_flight: int | None = None
    policy: str = AdmissionSettings.policy  # one of ADMISSION_POLICIES


@dataclass(frozen=True)
class QueueSettings:
    """The model's line (gateway/admission): requests waiting for a free slot, or for a replica
    while none is ready (loading, waking, restarting)."""

    max_requests: int = 64
    max_wait_s: float = 120.0
    # A failed model refuses requests 503 model_failed this long (their Retry-After), then the
    # next request tries to start it again.
    failed_retry_s: float = 30.0


@dataclass(frozen=True)
class Capabilities:
    """What an external upstream can do: a request using a feature it lacks gets the gateway's own
    400 naming the field, rather than the upstream's (possibly silent) mishandling. Local engines
    support every feature."""

    tools: bool = True  # tools / functions (tool calling)
    structured_outputs: bool = True  # response_format json_*, structured_outputs, guided_*


@dataclass(frozen=True)
class ModelConfig:
    name: str
    aliases: tuple[str, ...] = ()
    upstreams: tuple[str, ...] = ()  # external OpenAI-compatible servers: routed, never spawned
    source: str | None = None  # local model file or folder: the pool spawns engines for it
    upstream_model: str | None = None  # the name the upstream knows the model by
    api_key_env: str | None = None
    api_key: str | None = field(default=None, repr=False)
    health_path: str = "/ready"
    replicas: int = 1
    device: str = ModelDefaults.device
    max_model_len: int = ModelDefaults.max_model_len
    max_num_seqs: int = ModelDefaults.max_num_seqs
    gpu_memory_fraction: float | None = ModelDefaults.gpu_memory_fraction
    kv_cache_memory: int | None = ModelDefaults.kv_cache_memory
    engine_args: tuple[str, ...] = ()  # extra `python -m engine` flags
    # Derived, not configured: the fleet's only local engine may let idle threads spin briefly
    # (engine.model.cpu.openmp_env); with several, they would take each other's cores. The pool
    # reads it at each engine start; it never makes the pool replace a running engine.
    spin_wait: bool = False
    limits: ModelLimits = ModelLimits()
    timeouts: Timeouts = Timeouts()
    affinity: Affinity = Affinity()
    capabilities: Capabilities = Capabilities()
    # Residency (local models): "pinned" engines run from start to stop; "on_demand" ones start
    # at their first request and are parked (or stopped) after idle_ttl_s without requests.
    residency: str = "pinned"  # one of RESIDENCY_KINDS
    idle_ttl_s: float = 600.0
    priority: int = 0  # among idle on-demand models, lower priorities are evicted first
    memory_estimate: int | None = None  # one replica's footprint until the engine reports one
    queue: QueueSettings = QueueSettings()
    admission: ModelAdmission = ModelAdmission()

    @property
    def on_demand(self) -> bool:
        return self.local and self.residency == "on_demand"

    @property
    def local(self) -> bool:
        return self.source is not None

    @property
    def wire_name(self) -> str:
        """The model name requests carry upstream."""
        return self.upstream_model or self.name

    @property
    def max_in_flight(self) -> int:
        """Requests one available backend takes at once: as set, else a local engine's batch
        (``max_num_seqs``: more would wait in the engine's own first-come queue, where tenants
        look alike) or ``EXTERNAL_MAX_IN_FLIGHT``."""
        if self.admission.max_in_flight is not None:
            return self.admission.max_in_flight
        return self.max_num_seqs if self.local else EXTERNAL_MAX_IN_FLIGHT

    @property
    def gpu_share(self) -> float:
        """The GPU memory fraction one replica takes (0: not on a GPU). Every GPU counts as one
        card, as the sum check (MAX_GPU_FRACTION_SUM) does."""
        if not self.local or self.device == "cpu":
            return 0.0
        return self.gpu_memory_fraction or 0.0


@dataclass(frozen=True)
class FleetConfig:
    path: str
    gateway: GatewaySettings
    models: tuple[ModelConfig, ...]
