"""Distributed set-up: who am I, how many are we, and one process group for all.

Ranks are launched by `torchrun`, by MPI (`mpirun -np N`, Open MPI, MPICH/Hydra or
Intel MPI) or by Slurm's `srun`; `detect_env` reads rank and world size from
whichever launcher's variables are present. The collectives themselves always run
over torch.distributed: NCCL on GPU, gloo on CPU, or gloo on GPUs that several ranks
share (`placement`; this PyTorch build has no MPI backend, so MPI only starts the
processes and, when needed, tells them where to meet).

    env = detect_env()
    device = init_distributed(env, "cuda")
    ...
    loss = all_reduce_mean(loss)
    cleanup()

Rendezvous (`MASTER_ADDR`/`MASTER_PORT`): the environment's values when set
(torchrun always sets them). Under MPI without them, rank 0 opens the process group's
store on a port the system picks and broadcasts its address and port with mpi4py; the
other ranks connect to it (the port is bound before anyone hears of it, so no other
process can take it in between). Otherwise 127.0.0.1:29500, which only works when all
ranks share one node.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Launcher = Literal["single", "torchrun", "openmpi", "mpich", "slurm"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_TIMEOUT_S = 1800.0  # s, that any collective may wait for the others
DEFAULT_MASTER_PORT = 29500


class DistributedError(RuntimeError):
    """The launcher's environment is inconsistent or the process group cannot start."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0  # global rank of this process, 0 .. world_size-1
    world_size: int = 1  # processes in the whole job
    local_rank: int = 0  # rank among the processes on this node (picks the GPU)
    local_world_size: int = 1  # processes on this node
    launcher: Launcher = "single"  # which launcher's variables these came from

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise DistributedError(f"rank {self.rank} is not within world size {self.world_size}")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise DistributedError(
                f"local rank {self.local_rank} is not within local world size"
                f" {self.local_world_size}"
            )
        if self.local_world_size > self.world_size:
            raise DistributedError(
                f"local world size {self.local_world_size} exceeds world size {self.world_size}"
            )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size


# (launcher, rank, world size, local rank, local world size): the first launcher whose
# rank and world-size variables are both present wins. torchrun comes first because
# it may itself run inside an MPI or Slurm allocation.
_LAUNCHER_VARS: tuple[tuple[Launcher, str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    # SLURM_STEP_NUM_TASKS exists only inside an `srun` step, not in the batch script,
    # so a plain `python` in an sbatch script is not mistaken for rank 0 of N.
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", ""),
)


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None


def _slurm_local_size(environ: Mapping[str, str]) -> int | None:
    """Tasks on this node from SLURM_STEP_TASKS_PER_NODE (e.g. "4(x2),3") and SLURM_NODEID."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec or "SLURM_NODEID" not in environ:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = _int_var(environ, "SLURM_NODEID")
    return counts[node] if 0 <= node < len(counts) else None


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Rank, world size and node-local placement from the launcher's environment.

    Without any launcher variables this is a single process. When a launcher gives no
    node-local variables, all ranks are assumed to share one node.
    """
    for launcher, rank_var, size_var, local_var, local_size_var in _LAUNCHER_VARS:
        if rank_var not in environ or size_var not in environ:
            continue
        rank, world_size = _int_var(environ, rank_var), _int_var(environ, size_var)
        if local_var and local_var in environ:
            local_rank = _int_var(environ, local_var)
        else:
            local_rank = rank
        local_size: int | None = None
        if local_size_var and local_size_var in environ:
            local_size = _int_var(environ, local_size_var)
        elif launcher == "slurm":
            local_size = _slurm_local_size(environ)
        if local_size is None:
            # Unknown: one node if the local rank is the global one; otherwise the
            # smallest consistent count, which keeps single_node False (the safe side).
            local_size = world_size if local_rank == rank else local_rank + 1
        return DistEnv(rank, world_size, local_rank, local_size, launcher)
    return DistEnv()


class Meeting(NamedTuple):
    """Where the ranks meet: the store's address and port, and the store itself when the
    rendezvous opened it already (MPI); None: `init_process_group` opens it (env://)."""

    addr: str
    port: int
    store: Any = None


def _mpi_rendezvous(env: DistEnv) -> Meeting | None:
    """Rank 0 opens the store on a port the system picks; mpi4py broadcasts where, and the
    other ranks connect to it. None without mpi4py."""
    try:
        from mpi4py import MPI  # initialises MPI on import
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != env.world_size:
        raise DistributedError(
            f"MPI reports {comm.Get_size()} ranks but the environment says {env.world_size}"
        )
    timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
    store, chosen = None, None
    if comm.Get_rank() == 0:
        # One node: loopback always works. Several: the hostname, which the other
        # nodes resolve through the cluster's DNS (the store listens on all interfaces).
        addr = DEFAULT_MASTER_ADDR if env.single_node else socket.gethostname()
        # Port 0: the system's choice, bound now. Not waiting for the others: they learn
        # the port only from the broadcast below.
        store = dist.TCPStore(addr, 0, env.world_size, True, timeout, wait_for_workers=False)
        chosen = (addr, store.port)
    addr, port = comm.bcast(chosen, root=0)
    if store is None:
        store = dist.TCPStore(addr, port, env.world_size, False, timeout)
    return Meeting(addr, port, store)


def rendezvous(env: DistEnv, environ: Mapping[str, str] = os.environ) -> Meeting:
    """Where this job's ranks meet; see the module docstring for the order."""
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if addr and port:
        return Meeting(addr, _int_var(environ, "MASTER_PORT"))
    if env.launcher in ("openmpi", "mpich"):
        found = _mpi_rendezvous(env)
        if found is not None:
            return found
    if not env.single_node:
        log.warning(
            "MASTER_ADDR/MASTER_PORT are not set and mpi4py is unavailable: using %s:%d,"
            " which only works on one node. For several nodes export MASTER_ADDR (a host"
            " every rank can reach) and MASTER_PORT, or install mpi4py.",
            DEFAULT_MASTER_ADDR,
            DEFAULT_MASTER_PORT,
        )
    return Meeting(addr or DEFAULT_MASTER_ADDR, int(port) if port else DEFAULT_MASTER_PORT)


Backend = Literal["auto", "nccl", "gloo"]


def placement(
    env: DistEnv, device_type: str, backend: Backend = "auto", gpus: int | None = None
) -> tuple[torch.device, str]:
    """This rank's device and the process group's backend.

    "auto" is NCCL on GPUs (one GPU a rank: NCCL refuses two ranks on one GPU) and gloo
    on the CPU. gloo on GPUs lets ranks share them: local rank r runs on GPU r % GPUs
    (`gpus`, default: those visible), e.g. `mpirun -np 2` on a machine with one GPU.
    """
    if device_type == "cuda":
        gpus = torch.cuda.device_count() if gpus is None else gpus
        if gpus < 1:
            raise DistributedError(
                "device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES, the driver): train"
                " with device=cpu, or on a machine with a GPU"
            )
        if backend == "gloo":
            return torch.device("cuda", env.local_rank % gpus), "gloo"
        if env.local_rank >= gpus:
            raise DistributedError(
                f"local rank {env.local_rank} needs GPU {env.local_rank} but only {gpus} are"
                " visible; start at most that many ranks per node, or let ranks share"
                " GPUs with dist_backend=gloo"
            )
        return torch.device("cuda", env.local_rank), "nccl"
    if device_type == "cpu":
        if backend == "nccl":
            raise DistributedError("NCCL runs on GPUs only: device=cpu takes dist_backend gloo")
        return torch.device("cpu"), "gloo"
    raise DistributedError(f"device type {device_type!r} is not 'cuda' or 'cpu'")


def init_distributed(
    env: DistEnv,
    device_type: str,
    backend: Backend = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    environ: Mapping[str, str] = os.environ,
) -> torch.device:
    """Pin the device and join the process group (`placement`'s backend); returns this
    rank's device. A single process starts no process group. timeout_s bounds every
    collective, so a rank that dies turns into an error on the others rather than a hang.
    """
    device, backend = placement(env, device_type, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not env.is_distributed or dist.is_initialized():
        return device
    addr, port, store = rendezvous(env, environ)
    # Where the ranks met, for whoever looks (and env://, which reads these two).
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    log.info(
        "rank %d/%d (local %d/%d, %s) joining %s at %s:%d",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.launcher,
        backend,
        addr,
        port,
    )
    dist.init_process_group(
        backend,
        init_method=None if store is not None else "env://",
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return device


def is_main() -> bool:
    """True on rank 0, and in a single process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank; a no-op in a single process."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of `tensor` over all ranks, as a new floating-point tensor."""
    out = tensor.detach().clone()
    if not out.is_floating_point():
        out = out.double()
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out /= dist.get_world_size()
    return out


def all_gather_sizes(*sizes: int) -> torch.Tensor:
    """Every rank's `sizes`, as a (world size, len(sizes)) int64 tensor on the CPU, rank r's
    in row r; one row in a single process."""
    mine = torch.tensor(sizes, dtype=torch.int64)
    if not dist.is_initialized():
        return mine.unsqueeze(0)
    if dist.get_backend() == "nccl":  # NCCL moves only CUDA tensors
        mine = mine.cuda()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows).cpu()


def new_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A process group of every rank beside the default one (its collectives are ordered
    apart from those on the default group, DistributedDataParallel's), its collectives
    bounded as `init_distributed`'s; None in a single process."""
    if not dist.is_initialized():
        return None
    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; `[obj]` in a single process."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def cleanup() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
