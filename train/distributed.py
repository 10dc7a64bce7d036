"""Multi-process (multi-host) runs: `jax.distributed` start-up, the global mesh, per-process batches.

One Python process per host (or per GPU), all running the same program (multi-controller SPMD):

* `DistributedConfig` (--coordinator HOST:PORT --num-processes N --process-id I, or the
  PREFT_COORDINATOR / PREFT_NUM_PROCESSES / PREFT_PROCESS_ID environment variables;
  `--coordinator auto` lets `jax.distributed.initialize()` detect a TPU slice / SLURM / MPI cluster)
  and `initialize`, which starts `jax.distributed` with a bounded wait and a clear error when the
  coordinator cannot be reached (jax itself aborts the process after its timeout).
* `build_mesh`: the ("data", "fsdp", "tensor") mesh over *all* devices of all processes,
  process-major, so that each process's devices hold a contiguous block of every batch.
* `local_rows` / `put_batch`: each process reads only its rows of a global batch and the global
  array is assembled with `jax.make_array_from_process_local_data`.
* `is_primary` (process 0 writes metrics, logs and exports), `gather_to_host`, `global_max`,
  `on_primary` (process 0's work, its outcome shared); `lost_peer` / `abandon` (a run whose peer is gone).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from typing import Mapping

import jax
import numpy as np

from train.config import JsonConfig, MeshConfig

ENV = {"coordinator": "PREFT_COORDINATOR", "num_processes": "PREFT_NUM_PROCESSES",
       "process_id": "PREFT_PROCESS_ID", "local_device_count": "PREFT_LOCAL_DEVICE_COUNT",
       "initialization_timeout": "PREFT_INIT_TIMEOUT"}


class DistributedError(RuntimeError):
    """A multi-process run cannot start (bad flags, unreachable coordinator, mesh/device mismatch)."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig(JsonConfig):
    coordinator: str | None = None        # "HOST:PORT" of process 0, "auto", or None (single process)
    num_processes: int = 1
    process_id: int = 0
    local_device_count: int | None = None   # fake CPU devices per process (tests, laptops)
    initialization_timeout: int = 120     # seconds to wait for the coordinator and every process

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.local_device_count is not None and self.local_device_count < 1:
            raise ValueError(f"local_device_count must be >= 1, got {self.local_device_count}")
        if self.initialization_timeout < 1:
            raise ValueError("initialization_timeout must be >= 1 second")
        if self.coordinator not in (None, "auto"):
            self.address()            # validates HOST:PORT
        if self.num_processes > 1 and self.coordinator is None:
            raise ValueError(f"num_processes={self.num_processes} needs a coordinator address "
                             f"(--coordinator HOST:PORT or ${ENV['coordinator']})")

    @property
    def multi_process(self) -> bool:
        return self.coordinator is not None

    def address(self) -> tuple[str, int]:
        host, sep, port = str(self.coordinator).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"coordinator must be HOST:PORT (e.g. 10.0.0.2:1234), got {self.coordinator!r}")
        return host.strip("[]"), int(port)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "DistributedConfig":
        """Fields from PREFT_* environment variables; `overrides` (e.g. CLI values, None = unset) win."""
        environ = os.environ if environ is None else environ
        kw = {}
        for field, var in ENV.items():
            if environ.get(var):
                raw = environ[var]
                kw[field] = raw if field == "coordinator" else _int(raw, var)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def add_cli_args(parser) -> None:
    g = parser.add_argument_group("multi-process (each flag also reads its PREFT_* environment variable)")
    g.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0 (it listens there), or 'auto' (TPU slice, SLURM, MPI)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run (PREFT_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. n-1 (PREFT_PROCESS_ID)")
    g.add_argument("--local-device-count", type=int, default=None,
                   help="number of (fake) CPU devices in this process")
    g.add_argument("--init-timeout", type=int, default=None, dest="initialization_timeout",
                   help="seconds to wait for the coordinator and all processes (default 120)")


def config_from_args(args) -> DistributedConfig:
    return DistributedConfig.from_env(coordinator=args.coordinator, num_processes=args.num_processes,
                                      process_id=args.process_id, local_device_count=args.local_device_count,
                                      initialization_timeout=args.initialization_timeout)


# ------------------------------------------------------------------------------------ start-up
def _backends_initialized() -> bool:
    from jax._src import xla_bridge
    return bool(getattr(xla_bridge, "_backends", None))


def _wait_for_coordinator(host: str, port: int, timeout: float):
    """Returns once HOST:PORT accepts TCP connections; DistributedError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"could not reach the coordinator at {host}:{port} within {timeout:g} s ({last}). Start process 0 "
                f"with the same --coordinator (it listens there), check the address/port and firewall, or raise "
                f"--init-timeout.")
        time.sleep(0.2)


def _check_can_listen(port: int):
    """Process 0 hosts the coordination service on `port` (all interfaces): fail clearly if it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(f"process 0 cannot listen on coordinator port {port} ({e}): another program "
                                   f"(or an earlier run still shutting down) uses it; pick another port") from None


def initialize(cfg: DistributedConfig) -> None:
    """Configures local devices and starts jax.distributed (before any other jax use)."""
    if cfg.local_device_count is not None:
        if _backends_initialized():
            if jax.local_device_count() != cfg.local_device_count:
                raise DistributedError(f"local_device_count={cfg.local_device_count} requested after jax started "
                                       f"with {jax.local_device_count()} local devices")
        else:
            jax.config.update("jax_num_cpu_devices", cfg.local_device_count)
    if not cfg.multi_process:
        return
    if jax.distributed.is_initialized():
        return
    # CPU collectives across processes (no-op for GPU/TPU clients)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg.coordinator == "auto":
        jax.distributed.initialize(initialization_timeout=cfg.initialization_timeout)
        return
    host, port = cfg.address()
    if cfg.process_id == 0:
        _check_can_listen(port)
    else:
        _wait_for_coordinator(host, port, cfg.initialization_timeout)
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                               initialization_timeout=cfg.initialization_timeout)


def multi_process() -> bool:
    """This process is one of several of a jax.distributed run."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def shutdown() -> None:
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


# ---------------------------------------------------------------------------------- mesh / batches
def is_primary() -> bool:
    return jax.process_index() == 0


def build_mesh(mesh: MeshConfig) -> jax.sharding.Mesh:
    """The mesh over the devices of every process, process-major (process 0's devices first).

    A multi-process mesh must use every device; a single process may use a prefix of its devices."""
    from preft_jax import sharding as shd
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n, procs = len(devices), jax.process_count()
    if procs > 1 and mesh.size != n:
        raise DistributedError(
            f"mesh {mesh.data}x{mesh.fsdp}x{mesh.tensor} (data x fsdp x tensor) has {mesh.size} devices, but the "
            f"{procs} processes have {n} devices together ({jax.local_device_count()} per process); a multi-process "
            f"mesh must use all of them")
    if mesh.size > n:
        raise DistributedError(f"mesh {mesh.data}x{mesh.fsdp}x{mesh.tensor} (data x fsdp x tensor) needs "
                               f"{mesh.size} devices, {n} available")
    return shd.make_mesh(*mesh.shape, devices=devices)


def local_rows(mesh: jax.sharding.Mesh, batch_size: int) -> slice:
    """The rows [start, stop) of a global batch that this process's devices hold."""
    from preft_jax import sharding as shd
    if jax.process_count() == 1:
        return slice(0, batch_size)
    sharding = jax.sharding.NamedSharding(mesh, shd.batch_spec((batch_size,), mesh))
    idx = sorted({(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
                  for s in sharding.addressable_devices_indices_map((batch_size,)).values()})
    start, stop = idx[0][0], idx[0][1]
    for a, b in idx[1:]:
        if a > stop:
            raise DistributedError(f"this process's rows of a batch of {batch_size} are not contiguous: {idx}")
        stop = max(stop, b)
    return slice(start, stop)


def put_batch(batch: dict, mesh: jax.sharding.Mesh, global_batch_size: int | None = None) -> dict:
    """Global jax Arrays split on the batch dim from host arrays.

    `global_batch_size=None`: `batch` is the whole global batch (every process passes the same
    arrays; each keeps its rows). Otherwise `batch` holds only this process's `local_rows`."""
    from preft_jax import sharding as shd
    batch = {k: np.asarray(v) for k, v in batch.items()}
    if jax.process_count() == 1:
        return shd.shard_batch(batch, mesh)
    out = {}
    for k, v in batch.items():
        B = v.shape[0] if global_batch_size is None else global_batch_size
        shape = (B,) + v.shape[1:]
        rows = local_rows(mesh, B)
        local = v[rows] if global_batch_size is None else v
        if local.shape[0] != rows.stop - rows.start:
            raise ValueError(f"batch array {k!r}: this process holds {local.shape[0]} rows, its share of the "
                             f"global batch of {B} is rows {rows.start}:{rows.stop}")
        sharding = jax.sharding.NamedSharding(mesh, shd.batch_spec(shape, mesh))
        out[k] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out


def gather_to_host(tree):
    """numpy copies of (possibly multi-process sharded) arrays, on every process (a collective)."""
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
    from jax.experimental import multihost_utils
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def global_max(value: int) -> int:
    """max over processes of an int (a collective; the identity in a single process)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.asarray([value], np.int32))))


def on_primary(fn, what: str):
    """fn() on process 0 only, its outcome shared in one collective: every process goes on, or every
    process raises - process 0 its own error, the others a DistributedError quoting it - so no process
    is left in a barrier waiting for one that stopped (each prints its one `error:` line). Returns
    fn()'s value on process 0, None elsewhere; just fn() in a single process."""
    if jax.process_count() == 1:
        return fn()
    err, value = None, None
    if is_primary():
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - shared below, then raised as it was
            err = e
    said = _from_primary(b"" if err is None else str(err).encode("utf-8", "replace")[:8000])
    if err is not None:
        raise err
    if said:
        raise DistributedError(f"process 0 stopped while {what}: {said.decode('utf-8', 'replace')}")
    return value


def _from_primary(data: bytes) -> bytes:
    """Process 0's bytes on every process (a collective: every process calls it)."""
    from jax.experimental import multihost_utils
    n = int(multihost_utils.broadcast_one_to_all(np.asarray([len(data)], np.int32))[0])
    if n == 0:
        return b""
    buf = np.frombuffer(data, np.uint8) if is_primary() else np.zeros(n, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8))


_PEER_LOST = ("gloo", "connection reset", "connection refused", "broken pipe", "deadline_exceeded",
              "coordination service", "heartbeat", "unavailable")


def lost_peer(e: BaseException) -> str | None:
    """The one line for an error of a multi-process run that means another process of it is gone (it
    exited on its own error, was killed, or its host dropped): a failed cross-process collective. None
    for any other error, and in a single process."""
    if jax.process_count() == 1 or not isinstance(e, jax.errors.JaxRuntimeError):
        return None
    text = str(e)
    if not any(k in text.lower() for k in _PEER_LOST):
        return None
    first = text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__
    return (f"process {jax.process_index()} lost contact with another process of this run (it stopped: see "
            f"its own log) during a collective: {first}")


def abandon(code: int) -> None:
    """Ends the process now, without jax.distributed's shutdown barrier: after a lost peer that barrier
    waits for the heartbeat timeout and then aborts the process (SIGABRT, a C++ stack trace). Output
    streams and log handlers are flushed first."""
    import logging
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing more to say
            pass
    logging.shutdown()
    os._exit(code)
