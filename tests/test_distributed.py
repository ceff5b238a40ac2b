"""Launcher detection and a real two-rank gloo job under mpirun and torchrun-style env."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echoic.training import distributed
from echoic.training.distributed import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DistEnv,
    DistributedError,
    all_gather_object,
    all_reduce_mean,
    detect_env,
    init_distributed,
    is_main,
    placement,
    rendezvous,
)

# Open MPI 4.1 as root in a container: --allow-run-as-root because we are root,
# --oversubscribe because two ranks may exceed the cores, and the byte-transfer and
# out-of-band layers kept on loopback so no sandbox network interface is probed.
MPIRUN_ARGS = (
    "--allow-run-as-root",
    "--oversubscribe",
    "--mca",
    "btl",
    "self,tcp",
    "--mca",
    "btl_tcp_if_include",
    "lo",
    "--mca",
    "oob_tcp_if_include",
    "lo",
)

# Each rank joins the group, averages its rank and writes what it saw to OUT/rank<r>.json.
RANK_SCRIPT = """
import json, os, sys, torch
from echoic.training import distributed as d
env = d.detect_env()
d.init_distributed(env, "cpu", timeout_s=60)
mean = d.all_reduce_mean(torch.tensor([float(env.rank)]))
d.barrier()
seen = {
    "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
    "launcher": env.launcher, "mean": mean.item(), "main": d.is_main(),
    "master": os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"],
    "mpi4py": "mpi4py.MPI" in sys.modules,
    "gathered": d.all_gather_object({"rank": env.rank}),
}
with open(os.path.join(sys.argv[1], f"rank{env.rank}.json"), "w") as f:
    json.dump(seen, f)
d.cleanup()
"""

# A rank that exits after the rendezvous, and one that then waits for it at a collective.
DYING_SCRIPT = """
import torch
import torch.distributed as dist
from echoic.training import distributed as d
env = d.detect_env()
d.init_distributed(env, "cpu")
dist.all_reduce(torch.ones(1))
if env.rank == 1:
    raise SystemExit("rank 1 gives up after the rendezvous")
dist.all_reduce(torch.ones(1))
"""

# Each rank takes its share of one batch (batch_per = "step": utterances r, r + W, ...),
# pads it and weights its loss as training does (step_share), runs a tiny DS2 in float64
# with the norms' statistics shared, and averages gradients over the ranks as DDP does;
# it also computes the whole batch alone (the one-rank oracle), and its share without
# shared statistics (what training did before: the test's control). OUT/rank<r>.json.
SPLIT_SCRIPT = """
import json, os, sys, torch
from torch import nn
import torch.distributed as dist
from echoic.model.core.features import FeatureConfig
from echoic.model.nn.network import DeepSpeech2, ModelConfig
from echoic.training import distributed as d
from echoic.training.train import step_share
env = d.detect_env()
d.init_distributed(env, "cpu", timeout_s=60)
cfg = ModelConfig(features=FeatureConfig(mel_bins=40), conv_channels=(4, 4),
                  conv_kernel_freq=(11, 5), conv_kernel_time=(5, 5), conv_stride_freq=(2, 2),
                  conv_stride_time=(2, 1), rnn_layers=2, rnn_hidden=16, chunk_frames=8,
                  context_frames=3)
g = torch.Generator().manual_seed(1)
lengths = torch.tensor([97, 60, 55, 43, 30])
feats = torch.randn(5, 97, 40, generator=g, dtype=torch.float64)
for i, n in enumerate(lengths):
    feats[i, n:] = 0
targets = [torch.randint(1, 20, (int(n) // 12,), generator=g) for n in lengths]

def loss(model, x, rows):
    lp, out_len = model(x, lengths[rows])
    tg = [targets[i] for i in rows]
    return nn.functional.ctc_loss(lp.transpose(0, 1), torch.cat(tg), out_len,
        torch.tensor([len(t) for t in tg]), reduction="sum") / x.shape[0]

torch.manual_seed(0)
one = DeepSpeech2(cfg).double().train()
start = {k: v.clone() for k, v in one.state_dict().items()}
loss(one, feats, list(range(5))).backward()
rows = list(range(env.rank, 5, env.world_size))
mine = feats[rows][:, : int(lengths[rows].max())]
mine, share, frames = step_share(mine, int(lengths[rows].sum()), env.world_size)
group = d.new_group()
result = {"rank": env.rank, "share": share, "frames": frames, "padded": mine.shape[1]}
for name, shared in (("shared", True), ("alone", False)):
    model = DeepSpeech2(cfg).double().train()
    model.load_state_dict(start)
    model.share_norm_statistics(group if shared else None)
    (loss(model, mine, rows) * share).backward()
    worst = 0.0
    for (_, a), (_, b) in zip(one.named_parameters(), model.named_parameters()):
        dist.all_reduce(b.grad)
        b.grad /= env.world_size
        worst = max(worst, float((a.grad - b.grad).abs().max() / a.grad.abs().max()))
    result[name] = worst
    result[name + "_buffers"] = max(float((a - b).abs().max()) for a, b in
        zip(one.buffers(), model.buffers()) if a.is_floating_point())
    result[name + "_counts"] = all(torch.equal(a, b) for a, b in
        zip(one.buffers(), model.buffers()) if not a.is_floating_point())
with open(os.path.join(sys.argv[1], f"rank{env.rank}.json"), "w") as f:
    json.dump(result, f)
d.cleanup()
"""

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _clean_environ() -> dict[str, str]:
    """The test process's environment without any launcher variables of its own."""
    prefixes = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL")
    return {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(prefixes)
    }


def _read_ranks(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param({}, DistEnv(), id="single"),
        pytest.param(
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            DistEnv(3, 8, 1, 2, "torchrun"),
            id="torchrun",
        ),
        pytest.param(
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            DistEnv(5, 8, 1, 4, "openmpi"),
            id="openmpi",
        ),
        pytest.param(
            {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
            DistEnv(2, 4, 0, 2, "mpich"),
            id="mpich-hydra-or-intel-mpi",
        ),
        pytest.param(
            {"PMI_RANK": "1", "PMI_SIZE": "2"},
            DistEnv(1, 2, 1, 2, "mpich"),
            id="mpich-no-local-vars-means-one-node",
        ),
        pytest.param(
            {
                "SLURM_PROCID": "6",
                "SLURM_STEP_NUM_TASKS": "7",
                "SLURM_LOCALID": "2",
                "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "4(x1),3",
            },
            DistEnv(6, 7, 2, 3, "slurm"),
            id="slurm-srun",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"},
            DistEnv(),
            id="slurm-batch-script-is-single",
        ),
        pytest.param(
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "1",
            },
            DistEnv(1, 2, 1, 2, "torchrun"),
            id="torchrun-inside-mpi-allocation",
        ),
    ],
)
def test_detect_env(environ: dict[str, str], expected: DistEnv) -> None:
    assert detect_env(environ) == expected


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param({"RANK": "x", "WORLD_SIZE": "2"}, id="not-an-integer"),
        pytest.param({"RANK": "2", "WORLD_SIZE": "2"}, id="rank-out-of-range"),
        pytest.param(
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            id="local-rank-out-of-range",
        ),
    ],
)
def test_detect_env_rejects_inconsistent_variables(environ: dict[str, str]) -> None:
    with pytest.raises(DistributedError):
        detect_env(environ)


@pytest.mark.parametrize(
    ("env", "environ", "expected", "warning"),
    [
        pytest.param(
            DistEnv(0, 2, 0, 2, "torchrun"),
            {"MASTER_ADDR": "node7", "MASTER_PORT": "1234"},
            ("node7", 1234),
            "",
            id="from-environment",
        ),
        pytest.param(
            DistEnv(0, 2, 0, 2, "torchrun"),
            {},
            (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT),
            "",
            id="default-one-node",
        ),
        pytest.param(
            DistEnv(0, 4, 0, 2, "slurm"),
            {},
            (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT),
            f"using {DEFAULT_MASTER_ADDR}:{DEFAULT_MASTER_PORT}, which only works on one node",
            id="default-several-nodes-warns",
        ),
    ],
)
def test_rendezvous(
    env: DistEnv,
    environ: dict[str, str],
    expected: tuple[str, int],
    warning: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=distributed.log.name):
        assert rendezvous(env, environ) == (*expected, None)  # env:// opens the store
    said = [r.getMessage() for r in caplog.records if r.name == distributed.log.name]
    assert len(said) == (1 if warning else 0), said
    assert all(warning in message for message in said), said


def test_single_process_needs_no_process_group() -> None:
    device = init_distributed(DistEnv(), "cpu")
    assert device == torch.device("cpu")
    assert is_main()
    assert all_gather_object("only") == ["only"]
    assert all_reduce_mean(torch.tensor([3, 5])).tolist() == [3.0, 5.0]


def test_unknown_device_type_is_an_error() -> None:
    with pytest.raises(DistributedError, match="'tpu'"):
        init_distributed(DistEnv(), "tpu")


def _rank(local_rank: int) -> DistEnv:
    return DistEnv(rank=local_rank, world_size=4, local_rank=local_rank, local_world_size=4)


@pytest.mark.parametrize(
    ("device_type", "backend", "local_rank", "gpus", "placed"),
    [
        pytest.param("cuda", "auto", 1, 2, ("cuda:1", "nccl"), id="gpu-a-rank"),
        pytest.param("cuda", "nccl", 1, 2, ("cuda:1", "nccl"), id="nccl-named"),
        pytest.param("cuda", "gloo", 3, 1, ("cuda:0", "gloo"), id="four-ranks-share-one-gpu"),
        pytest.param("cuda", "gloo", 3, 2, ("cuda:1", "gloo"), id="four-ranks-share-two-gpus"),
        pytest.param("cpu", "auto", 3, 0, ("cpu", "gloo"), id="cpu"),
        pytest.param("cpu", "gloo", 3, 0, ("cpu", "gloo"), id="cpu-gloo-named"),
    ],
)
def test_placement(device_type, backend, local_rank: int, gpus: int, placed) -> None:
    """Where a rank runs and over what (no GPU needed: the GPU count is given)."""
    device, chosen = placement(_rank(local_rank), device_type, backend, gpus=gpus)
    assert (str(device), chosen) == placed


@pytest.mark.parametrize(
    ("device_type", "backend", "gpus", "message"),
    [
        pytest.param("cuda", "auto", 1, "or let ranks share GPUs with dist_backend=gloo",
                     id="nccl"),
        pytest.param("cpu", "nccl", 1, "NCCL runs on GPUs only", id="nccl-on-cpu"),
        pytest.param("cuda", "gloo", 0, "no GPU is visible", id="gloo-without-gpus"),
        pytest.param("cuda", "auto", 0, "no GPU is visible", id="nccl-without-gpus"),
    ],
)  # fmt: skip
def test_placement_refuses_what_cannot_run(device_type, backend, gpus: int, message: str) -> None:
    """NCCL takes one GPU a rank: a fourth rank with one GPU is told how to share it; and
    no rank runs on GPUs that are not there (gloo once divided by their count, zero)."""
    with pytest.raises(DistributedError, match=message):
        placement(_rank(3), device_type, backend, gpus=gpus)


def _mpirun(
    script: str, ranks: int, out: Path, timeout_s: float = 180
) -> subprocess.CompletedProcess:
    """Run `script` (its one argument: `out`) on `ranks` ranks under mpirun, with no
    launcher variables of the test's own; longer than `timeout_s` fails the test."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed")
    pytest.importorskip("mpi4py", reason="mpi4py (the train extra) is not installed")
    path = out / "rank.py"
    path.write_text(script)
    cmd = [mpirun, *MPIRUN_ARGS, "-np", str(ranks), sys.executable, str(path), str(out)]
    return subprocess.run(
        cmd, env=_clean_environ(), capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _mpirun_script(script: str, ranks: int, out: Path) -> list[dict]:
    """`_mpirun`, which must succeed: what each rank wrote to out/rank<r>.json."""
    proc = _mpirun(script, ranks, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _read_ranks(out, ranks)


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_mpirun_job_in_seconds(tmp_path: Path) -> None:
    """A rank that exits after the rendezvous does not leave the others waiting at their
    next collective for the job's timeout (30 minutes): Open MPI ends the job, with an
    error (6 s here), or gloo's peer sees the connection close. A job still running after
    two minutes fails the test (TimeoutExpired)."""
    proc = _mpirun(DYING_SCRIPT, 2, tmp_path, timeout_s=120)
    assert proc.returncode != 0
    assert "gives up after the rendezvous" in proc.stderr


@pytest.mark.slow
def test_mpirun_two_ranks_all_reduce_over_gloo(tmp_path: Path) -> None:
    """No MASTER_ADDR/PORT: rank 0 picks a free port and mpi4py broadcasts it, so the
    ranks meet there and not at the one-node fallback (tests/mutations checks that)."""
    ranks = _mpirun_script(RANK_SCRIPT, 2, tmp_path)
    assert [(r["rank"], r["world_size"], r["launcher"]) for r in ranks] == [
        (0, 2, "openmpi"),
        (1, 2, "openmpi"),
    ]
    assert [r["mean"] for r in ranks] == [0.5, 0.5]
    assert [r["main"] for r in ranks] == [True, False]
    assert ranks[1]["gathered"] == [{"rank": 0}, {"rank": 1}]
    assert ranks[0]["master"] == ranks[1]["master"]
    # One node: loopback, at the port rank 0 found free (never 29500, below the
    # ephemeral range), and both ranks loaded mpi4py's MPI to hear it.
    fallback = f"{DEFAULT_MASTER_ADDR}:{DEFAULT_MASTER_PORT}"
    assert ranks[0]["master"] != fallback, f"ranks met at {fallback}: not through mpi4py"
    assert ranks[0]["master"].startswith(f"{DEFAULT_MASTER_ADDR}:")
    assert [r["mpi4py"] for r in ranks] == [True, True], "not through mpi4py"


@pytest.mark.slow
def test_a_batch_split_over_ranks_has_the_gradient_of_one_rank(tmp_path: Path) -> None:
    """Three ranks each take a share (2, 2 and 1 of 5 utterances) of one batch, as
    batch_per = "step" deals it: with the batch norms' statistics shared and the loss
    weighted by its share, their mean gradient is one rank's on the whole batch to
    float64 rounding, and so are the norms' running statistics; the same shares with
    each rank's own statistics are nowhere near it."""
    ranks = _mpirun_script(SPLIT_SCRIPT, 3, tmp_path)
    assert [r["share"] for r in ranks] == [1.2, 1.2, 0.6]  # 3 x 2/5, 3 x 2/5, 3 x 1/5
    assert {r["frames"] for r in ranks} == {97 + 60 + 55 + 43 + 30}
    assert {r["padded"] for r in ranks} == {97}  # every share padded to the longest
    for r in ranks:
        assert r["shared"] < 1e-9 and r["shared_buffers"] < 1e-12 and r["shared_counts"], r
        assert r["alone"] > 1e-2 and r["alone_buffers"] > 1e-3, r


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_torchrun_style_env_two_ranks_all_reduce_over_gloo(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env={
                **_clean_environ(),
                **master,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
            },
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    ranks = _read_ranks(tmp_path, 2)
    assert [(r["rank"], r["launcher"], r["mean"]) for r in ranks] == [
        (0, "torchrun", 0.5),
        (1, "torchrun", 0.5),
    ]
    assert ranks[0]["master"] == f"127.0.0.1:{master['MASTER_PORT']}"
