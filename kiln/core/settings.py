"""Process settings from ``KILN_*`` environment variables. Read only by entry points.

Domain code receives the values it needs as arguments; it never reads the environment itself.
"""

from __future__ import annotations

from pathlib import Path

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.core.policy.engine import DEFAULT_DECODE_TILE
from kiln.core.run_plan import MAX_RUN_PARALLEL_GROUPS, PARALLEL_GROUPS

CONTROL_TASK_QUEUE = "kiln-control"
GPU_TASK_QUEUE = "kiln-gpu"


class Settings(BaseSettings):
    """Every knob an operator can set. Unset Temporal/S3 means "start the embedded stack"."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    home: Path = Path(".kiln")
    temporal_address: str | None = None
    temporal_namespace: str = "default"
    temporal_port: int = 7233
    temporal_ui_port: int = 8233
    temporal_ui_url: str | None = None
    # The embedded Temporal: auto = in its own user+network namespace, reached by the home's owner
    # only, where the machine allows it; off = on the host loopback, open to every local user.
    temporal_isolation: Literal["auto", "off"] = "auto"
    # TLS / mTLS / Temporal Cloud: PEM file paths, and an API key (sent as a bearer token; implies TLS).
    temporal_tls_cert: Path | None = None
    temporal_tls_key: Path | None = None
    temporal_tls_ca: Path | None = None
    temporal_api_key: SecretStr | None = None
    # How long a worker keeps retrying its first connection to Temporal (backoff, logged) before exiting.
    temporal_connect_timeout_s: float = 300.0
    s3_endpoint: str | None = None
    # Unset: the key pair generated for this home (``<home>/s3-credentials.json``, 0600).
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_bucket: str = "kiln"
    s3_region: str = "us-east-1"
    s3_port: int = 8333
    model_path: Path | None = None
    # More models to serve: each sub-folder (with a config.json) is a model a run may name.
    models_dir: Path | None = None
    # Where the gpu worker computes (sampling and training share it): auto = CUDA when available.
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    # auto = bfloat16 on CUDA, float32 on CPU.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    api_host: str = "127.0.0.1"
    api_port: int = 8780
    api_url: str | None = None
    # A request body must arrive within this many seconds (uploads: 10x); 408 and close otherwise.
    api_body_timeout_s: float = Field(default=30.0, gt=0)
    control_task_queue: str = CONTROL_TASK_QUEUE
    gpu_task_queue: str = GPU_TASK_QUEUE
    allow_remote_environments: bool = False
    gpu_max_concurrent_activities: int = 2
    # Groups one run keeps in flight (collect_group activities at once), read at admission. Unset:
    # sized for this process's engine (see ``parallel_groups_per_run``; docs/engines.md).
    run_parallel_groups: int | None = Field(default=None, ge=1, le=MAX_RUN_PARALLEL_GROUPS)
    # The rollout engine of this worker (docs/engines.md): hf = Kiln's batch-invariant sampler in
    # the worker (byte-reproducible, the reference); vllm = a vLLM server process in its own venv.
    engine: Literal["hf", "vllm"] = "hf"
    # Rows the hf engine decodes per forward (docs/engines.md "The decode tile"): part of the
    # behaviour identity; 1 = one row at a time (no padding cost for single-row calls).
    hf_decode_tile: int = Field(default=DEFAULT_DECODE_TILE, ge=1, le=256)
    # The vllm engine's Python (default: .venv-vllm/bin/python of the Kiln checkout).
    vllm_python: Path | None = None
    # With the vllm engine a gpu worker runs this many activities at once (continuous batching).
    vllm_max_concurrent_activities: int = Field(default=32, ge=1)
    # Share of the GPU's memory vLLM may take (weights + KV cache); the trainer uses the rest.
    vllm_gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    # KV-cache size in GB of the CPU build (VLLM_CPU_KVCACHE_SPACE).
    vllm_cpu_kvcache_gb: int = Field(default=4, ge=1)
    vllm_max_model_len: int = Field(default=4096, ge=64)
    # The devices one vllm engine server spans (vLLM's tensor-parallel size), and how many servers a
    # gpu worker runs (each on devices of its own, an episode's turns sticky to one); checked, with
    # an error naming the setting, when the worker builds its engines (docs/engines.md).
    vllm_tensor_parallel: int = 1
    vllm_engines: int = 1
    # Train on the policy runtime's own base model (one copy in memory) instead of a second copy.
    # Sampling afterwards is bit-identical to a fresh worker's (docs/models.md); false loads a
    # second copy for training (twice the weight memory, sampling not blocked while training).
    share_base_model: bool = True
    # Devices one training spans (docs/deploying.md "A trainer across GPUs"): 1 = one process, on
    # KILN_DEVICE (the default); N = N ranks, FSDP2 over cuda:0 … cuda:N-1 with NCCL, or N gloo
    # ranks on the CPU; auto = every visible CUDA GPU (1 without CUDA).
    train_devices: str = Field(default="1", pattern=r"^(auto|[1-9][0-9]*)$")
    # A rank waits at most this long in one collective (a peer that hangs) before the attempt fails.
    train_collective_timeout_s: float = Field(default=300.0, gt=0)
    max_active_runs: int = 4
    max_tracked_runs: int = 128
    heartbeat_timeout_s: float = 30.0
    api_token: str | None = None
    retained_budget_bytes: int = 512 * 1024 * 1024
    # A worker serves Prometheus ``/metrics`` on this port when set (the API serves it on its own).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # {"<credential id>": {"origin": "https://host[:port]", "bearer_token_env": "VAR"}}
    credentials: dict[str, dict[str, str]] = {}

    @field_validator("temporal_tls_cert", "temporal_tls_key", "temporal_tls_ca", "temporal_api_key", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``KILN_TEMPORAL_API_KEY=`` (e.g. ``${VAR:-}`` in compose) means unset, not an empty key."""
        return None if isinstance(value, str) and not value.strip() else value

    @property
    def gpu_concurrency(self) -> int:
        """How many activities a gpu worker runs at once (many with the batching vllm engine)."""
        return self.vllm_max_concurrent_activities if self.engine == "vllm" else self.gpu_max_concurrent_activities

    @property
    def parallel_groups_per_run(self) -> int:
        """Groups one run keeps in flight: ``run_parallel_groups`` when set; otherwise, with the
        vllm engine, as many as a gpu worker runs at once (so that one run fills the engine's
        batches), and ``PARALLEL_GROUPS`` with hf."""
        if self.run_parallel_groups is not None:
            return self.run_parallel_groups
        if self.engine == "vllm":
            return min(self.vllm_max_concurrent_activities, MAX_RUN_PARALLEL_GROUPS)
        return PARALLEL_GROUPS

    @property
    def resolved_api_url(self) -> str:
        return self.api_url or f"http://{self.api_host}:{self.api_port}"

    @property
    def default_model_path(self) -> Path:
        """Where the demo's tiny model lives when ``KILN_MODEL_PATH`` is not set."""
        return self.model_path or (self.home / "models" / "tiny")

    @property
    def effective_temporal_ui_url(self) -> str | None:
        if self.temporal_ui_url:
            return self.temporal_ui_url.rstrip("/")
        if self.temporal_address:
            return None
        return f"http://127.0.0.1:{self.temporal_ui_port}"

    def run_ui_link(self, run_id: str) -> str | None:
        """The Temporal Web UI page of a run, when the UI's address is known."""
        base = self.effective_temporal_ui_url
        if base is None:
            return None
        return f"{base}/namespaces/{self.temporal_namespace}/workflows/{run_id}"

    @property
    def effective_temporal_address(self) -> str:
        return self.temporal_address or f"127.0.0.1:{self.temporal_port}"

    def s3_key_pair(self) -> tuple[str, str]:
        """``(access_key, secret_key)``: each explicit setting wins; the rest come from the home's
        generated pair (:func:`kiln.core.home.home_s3_key_pair`, created on first use)."""
        if self.s3_access_key is not None and self.s3_secret_key is not None:
            return self.s3_access_key, self.s3_secret_key
        from kiln.core.home import home_s3_key_pair

        access, secret = home_s3_key_pair(self.home)
        return self.s3_access_key or access, self.s3_secret_key or secret

    @property
    def effective_s3_endpoint(self) -> str:
        return self.s3_endpoint or f"http://127.0.0.1:{self.s3_port}"


def load_settings() -> Settings:
    return Settings()
