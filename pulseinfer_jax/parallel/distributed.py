"""Several hosts: `jax.distributed.initialize` from the CLI's --coordinator / --num-processes / --process-id.

Every process runs the same command with its own --process-id; after `initialize`, `jax.devices()` lists the devices
of every process, and `DeviceLayout.of(tensor_parallel)` builds its `tp` mesh over the first `tensor_parallel` of
them. Must run before anything starts a jax backend (the CLI calls it first). On CPU backends the processes'
collectives go through gloo.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits among the processes of one multi-host run."""

    coordinator: str  # "host:port" of process 0's coordination service
    num_processes: int
    process_id: int

    def __post_init__(self) -> None:
        if ":" not in self.coordinator:
            raise ValueError(f"--coordinator={self.coordinator!r} must be host:port (process 0's address)")
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id={self.process_id} must be in [0, --num-processes={self.num_processes})")

    def initialize(self) -> None:
        """Join the run (blocks until every process has joined or the coordinator times out)."""
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise RuntimeError("jax already started a backend: the multi-host setup must come first in the process")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (CPU backends only; GPUs use NCCL)
        jax.distributed.initialize(coordinator_address=self.coordinator, num_processes=self.num_processes,
                                   process_id=self.process_id)


def cluster_from_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> Cluster | None:
    """The CLI's three options as a Cluster (None when none is given); a clear error when only some are."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("a multi-host run needs all of --coordinator, --num-processes and --process-id")
    return Cluster(coordinator, num_processes, process_id)
