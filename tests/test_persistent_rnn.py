"""Persistent RNN kernels: the reference math, the autograd function, the network's
wiring, the Triton kernels (interpreter, offline sm_90 compile) and, on a GPU,
the kernels against cuDNN.

Checks that need a fresh interpreter (TRITON_INTERPRET=1, a GPU with a timeout,
no triton at all) run this file as a script: `python -m tests.test_persistent_rnn
CHECK JSON` prints one JSON line. They run with ECHOIC_PERSISTENT_STRICT=1: a
fallback to cuDNN there (whose results would pass any comparison with cuDNN) is an
error, and so a failed check, not a warning that nobody sees.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from echoic.model.nn.network import ClippedReLURNN, DeepSpeech2, _reverse_within
from echoic.model.nn.persistent import KernelConfig, Problem, capacity, function, recurrences
from echoic.model.nn.persistent.reference import backward as reference_backward
from echoic.model.nn.persistent.reference import positions as reference_positions
from tests.tiny import TINY

ROOT = Path(__file__).resolve().parents[1]
STRICT = function.STRICT_ENV


@pytest.fixture(autouse=True)
def lenient_unless_a_test_says(monkeypatch) -> None:
    """The tests in this process set strict mode themselves, whatever the environment
    says; the check processes run strict (`_run_check`)."""
    monkeypatch.delenv(STRICT, raising=False)


def _module(kind: str, d: int, h: int, dtype=torch.float64, device="cpu") -> nn.Module:
    if kind == "gru":
        m = nn.GRU(d, h, batch_first=True)
    elif kind == "relu":
        m = nn.RNN(d, h, nonlinearity="relu", batch_first=True)
    else:
        m = ClippedReLURNN(d, h, clip=0.4)
    return m.to(device=device, dtype=dtype)


def _modules_path(problems: list[Problem]) -> list[torch.Tensor]:
    """What the network computes with the modules themselves (cuDNN on a GPU)."""
    outs = []
    for p in problems:
        h0 = None if p.h0 is None else p.h0.unsqueeze(0)
        if p.reverse:
            back = p.rnn(_reverse_within(p.x, p.lengths), h0)[0]
            outs.append(_reverse_within(back, p.lengths))
        else:
            outs.append(p.rnn(p.x, h0)[0])
    return outs


def _two_problems(kind: str, d: int, h: int, dtype=torch.float64, device="cpu", batch=3, steps=6):
    """A forward direction from h0 and a backward one over windows of unequal lengths."""
    torch.manual_seed(0)
    fwd, bwd = _module(kind, d, h, dtype, device), _module(kind, d, h, dtype, device)
    x = torch.randn(batch, steps, d, dtype=dtype, device=device, requires_grad=True)
    h0 = (0.5 * torch.randn(batch, h, dtype=dtype, device=device)).requires_grad_()
    win = torch.randn(batch + 1, steps - 1, d, dtype=dtype, device=device, requires_grad=True)
    lengths = torch.arange(batch + 1, device=device) % (steps - 1) + 1  # 1 .. T-1, and T-1
    lengths[-1] = steps - 1
    problems = [Problem(fwd, x, h0), Problem(bwd, win, None, lengths, reverse=True)]
    leaves = [x, h0, win, *fwd.parameters(), *bwd.parameters()]
    return problems, leaves


def _cell(kind: str) -> str:
    return "gru" if kind == "gru" else "rnn"


def _clip(kind: str) -> float:
    return 0.4 if kind == "clipped" else float("inf")


def _max_errors(outs, expected, leaves, expected_leaves=None) -> tuple[float, float]:
    """Largest relative difference of the outputs and of all gradients (with respect to
    `leaves`, and for `expected` to `expected_leaves` where it has its own, e.g. float64
    copies). `expected`'s graph is kept: the GPU checks measure several implementations
    against one reference."""
    torch.manual_seed(1)
    weights = [torch.randn_like(e) for e in expected]
    got = torch.autograd.grad(
        sum((o * w.to(o.dtype)).sum() for o, w in zip(outs, weights, strict=True)), leaves
    )
    want = torch.autograd.grad(
        sum((e * w).sum() for e, w in zip(expected, weights, strict=True)),
        leaves if expected_leaves is None else expected_leaves,
        retain_graph=True,
    )

    def rel(a, b):
        return (
            (a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)
        ).item()

    return (
        max(rel(o, e) for o, e in zip(outs, expected, strict=True)),
        max(rel(a, b) for a, b in zip(got, want, strict=True)),
    )


KINDS = [
    pytest.param("gru", id="gru"),
    pytest.param("relu", id="rnn-relu"),
    pytest.param("clipped", id="rnn-clipped-relu"),
]


# ---- reference math and the autograd function (float64, CPU) ----------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reference_equals_torch_modules(kind: str) -> None:
    problems, leaves = _two_problems(kind, d=5, h=7)
    outs = recurrences(_cell(kind), problems, _clip(kind), backend="reference")
    out_err, grad_err = _max_errors(outs, _modules_path(problems), leaves)
    assert out_err < 1e-12
    assert grad_err < 1e-12


def test_several_implementations_measure_against_one_reference() -> None:
    """The GPU checks call `_max_errors` once per implementation (the kernels, cuDNN
    under autocast) against one float32 reference; here on CPU tensors, as they do."""
    problems, leaves = _two_problems("gru", d=5, h=7, dtype=torch.float32)
    expected = _modules_path(problems)
    first = recurrences("gru", problems, backend="reference")
    second = _modules_path(problems)
    errors = [_max_errors(outs, expected, leaves) for outs in (first, second)]
    assert max(errors[0]) < 1e-5
    assert errors[1] == (0.0, 0.0)
    # ... and against float64 copies, as the fp32 GPU check does
    exact, exact_leaves = _in_float64(problems, leaves)
    expected = _modules_path(exact)
    assert exact[0].x.dtype == torch.float64 and exact[0].x is not problems[0].x
    for outs in (recurrences("gru", problems, backend="reference"), _modules_path(problems)):
        errors = _errors_against(outs, leaves, expected, exact_leaves, relu=True)
        assert errors["out"] < 1e-5 and errors["grad"] < 1e-5 and errors["flips"] == 0, errors


def test_relu_gradients_at_the_kernels_own_activations() -> None:
    """The tiles check's measure for ReLU cells, on CPU tensors with the reference
    backend standing in for the kernels: float32 against float64 at the same
    activations is rounding alone; a wrong gradient (a path into h0 that adds nothing
    to the values) shows."""
    problems, leaves = _two_problems("relu", d=5, h=7, dtype=torch.float32, steps=9)
    outs = recurrences("rnn", problems, backend="reference")
    assert _relu_grad_error(problems, leaves, outs) < 1e-5
    outs = recurrences("rnn", problems, backend="reference")
    h0 = problems[0].h0.unsqueeze(1)  # (N, 1, H)
    wrong = [outs[0] + 0.5 * (h0 - h0.detach()), outs[1]]
    assert _relu_grad_error(problems, leaves, wrong) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_function_gradcheck(kind: str) -> None:
    problems, leaves = _two_problems(kind, d=2, h=3, batch=2, steps=4)

    def run(*_: torch.Tensor) -> tuple[torch.Tensor, ...]:  # gradcheck perturbs `leaves` in place
        return tuple(recurrences(_cell(kind), problems, _clip(kind), backend="reference"))

    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-7)


def test_more_than_two_directions_need_the_reference_backend() -> None:
    problems, _ = _two_problems("gru", d=2, h=3)
    with pytest.raises(ValueError, match="at most two"):
        recurrences("gru", problems * 2, backend="triton")


# ---- the network's wiring ----------------------------------------------------------

LAYERS = [
    pytest.param(dict(chunk_frames=4, context_frames=2), id="bigru-chunk4-ctx2"),
    pytest.param(dict(), id="bigru-whole"),
    pytest.param(dict(rnn_type="rnn", chunk_frames=5, context_frames=1), id="birnn-chunk5-ctx1"),
    pytest.param(dict(bidirectional=False, context_frames=3), id="unigru-rowconv3"),
]


def _loss_and_grads(model: DeepSpeech2, feats, lengths) -> tuple[torch.Tensor, list]:
    log_probs, out_len = model(feats, lengths)
    loss = (log_probs * torch.linspace(-1, 1, log_probs.shape[-1])).sum()
    return log_probs, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("changes", LAYERS)
def test_network_through_the_function_equals_the_modules(changes: dict, monkeypatch) -> None:
    torch.manual_seed(0)
    model = DeepSpeech2(dataclasses.replace(TINY, **changes)).train()
    feats = torch.randn(3, 41, 20)
    lengths = torch.tensor([41, 30, 17])
    keys = list(model.state_dict())
    expected, want = _loss_and_grads(model, feats, lengths)
    # The seam: the kernels' choice on a GPU, here the reference backend on the CPU;
    # this test is about what the layer feeds the function and does with its outputs.
    calls = []
    monkeypatch.setattr(function, "choose", lambda *args: calls.append(args) or ("reference", None))
    model.set_rnn_impl("persistent")
    got, have = _loss_and_grads(model, feats, lengths)
    assert len(calls) == TINY.rnn_layers
    assert (got - expected).abs().max().item() < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(have, want, strict=True)) < 1e-4
    assert list(model.state_dict()) == keys  # checkpoints are interchangeable


@pytest.mark.parametrize("changes", LAYERS)
def test_every_state_handed_to_a_module_is_contiguous(changes: dict, monkeypatch) -> None:
    """cuDNN refuses a strided initial state ("rnn: hx is not contiguous"), the CPU
    modules take it: with the persistent path's outputs (the reference backend stands in
    for the kernels), every state the layers hand to a module is contiguous."""
    monkeypatch.setattr(function, "choose", lambda *args: ("reference", None))
    torch.manual_seed(0)
    model = DeepSpeech2(dataclasses.replace(TINY, **changes)).train()
    model.set_rnn_impl("persistent")
    states = []

    def record(module: nn.Module, args: tuple) -> None:
        if len(args) > 1 and args[1] is not None:
            states.extend(args[1] if isinstance(args[1], tuple) else [args[1]])

    for layer in model.rnns:
        for module in (layer.fwd, layer.bwd):
            if module is not None:
                module.register_forward_pre_hook(record)
    _loss_and_grads(model, torch.randn(3, 41, 20), torch.tensor([41, 30, 17]))
    assert all(s.is_contiguous() for s in states), [s.stride() for s in states]


def test_the_training_step_check_on_the_cpu() -> None:
    """The GPU's training-step check, run on the CPU (where every implementation runs
    the modules): what it measures is well-formed, and float32 is near float64."""
    result = _check_gpu_train_step({"device": "cpu"})
    assert result["launches"] == {k: {"forward": 0, "backward": 0} for k in ("cudnn", "persistent")}
    assert result["grad"] == 0.0
    assert abs(result["cudnn"] - result["float64"]) <= 1e-4 * abs(result["float64"])
    assert 0 < result["grad_vs_float64"]["cudnn"] < 1e-2, result


@pytest.mark.parametrize("impl", ["persistent", "auto"])
def test_cpu_runs_the_modules(impl: str) -> None:
    torch.manual_seed(0)
    model = DeepSpeech2(dataclasses.replace(TINY, chunk_frames=4, context_frames=2)).eval()
    feats, lengths = torch.randn(2, 30, 20), torch.tensor([30, 22])
    with torch.no_grad():
        expected, _ = model(feats, lengths)
        model.set_rnn_impl(impl)
        got, _ = model(feats, lengths)
    assert torch.equal(got, expected)


def test_imports_and_runs_without_triton() -> None:
    result = _run_check("no-triton", {}, timeout=120)
    assert result == {"launch": "ImportError", "reference_ok": True}


def test_gpu_check_script_imports_echoic_from_the_checkout(tmp_path: Path) -> None:
    """scripts/gpu_check.sh (for GPU machines without an echoic install) imports the
    checkout's own folders, the training side included."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    env["GPU_CHECK_WORK"] = str(tmp_path)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "env"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "out" / "env.log").read_text()
    assert f"echoic imports: ok, from {tmp_path}/.gpu-path/echoic/model/nn/persistent" in log
    assert "torch" in log and "triton" in log


# ---- the Triton kernels under the interpreter ----------------------------------------

# Tensor-core tiles run in float16 here: the interpreter's own bf16 tl.dot is wrong
# (Triton 3.9: a plain 3-d bf16 dot is off by orders of magnitude, fp16 and fp32 are
# exact), so bf16 tiles are checked by the sm_90 compile and on a GPU.
INTERPRETER = [
    pytest.param("gru", "triton", 0, 1, 2, "float32", id="gru-persistent-fp32"),
    pytest.param("clipped", "triton", 0, 1, 2, "float32", id="rnn-persistent-fp32"),
    pytest.param("gru", "triton-steps", 4, 1, 2, "float32", id="gru-steps-4-programs-fp32"),
    pytest.param("relu", "triton-steps", 4, 1, 2, "float32", id="rnn-steps-4-programs-fp32"),
    pytest.param("gru", "triton-steps", 8, 1, 2, "bfloat16", id="gru-steps-bf16"),
    pytest.param("gru", "triton", 0, 1, 2, "bfloat16", id="gru-persistent-bf16-exchange"),
    pytest.param("relu", "triton", 0, 1, 3, "bfloat16", id="rnn-persistent-bf16-exchange"),
    pytest.param("clipped", "triton-steps", 8, 1, 2, "float16", id="rnn-steps-fp16"),
    pytest.param("gru", "triton", 0, 16, 2, "float16", id="gru-persistent-tiles-fp16"),
    pytest.param("gru", "triton-steps", 16, 16, 20, "float16", id="gru-steps-2-tiles-fp16"),
    pytest.param("relu", "triton-steps", 16, 16, 20, "float16", id="rnn-steps-2-tiles-fp16"),
    pytest.param("clipped", "triton", 0, 32, 3, "float16", id="rnn-persistent-32-row-tiles-fp16"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "backend", "block_h", "block_b", "batch", "dtype"), INTERPRETER)
def test_kernels_in_the_interpreter(
    kind: str, backend: str, block_h: int, block_b: int, batch: int, dtype: str
) -> None:
    """Persistent mode with one program per direction (its barrier completes when the
    interpreter runs programs one after another); one launch per step with several;
    rows one at a time (block_b 1) or in tensor-core tiles, one or several a step."""
    pytest.importorskip("triton")
    args = dict(kind=kind, backend=backend, block_h=block_h, block_b=block_b, batch=batch)
    args["dtype"] = dtype
    result = _run_check("interpreter", args, timeout=300, env={"TRITON_INTERPRET": "1"})
    out_tol, grad_tol = (1e-5, 1e-4) if dtype == "float32" else (3e-2, 5e-2)
    assert result["out"] < out_tol
    assert result["grad"] < grad_tol


@pytest.mark.slow
def test_barrier_timeout_fails_cleanly_in_the_interpreter() -> None:
    """Several programs a direction cannot meet when the interpreter runs them in turn:
    the first gives up after its timeout (20 polls there), flags it and releases the rest."""
    pytest.importorskip("triton")
    result = _run_check("timeout", {}, timeout=300, env={"TRITON_INTERPRET": "1"})
    assert result == {"error": "PersistentKernelError", "timed_out": True}


@pytest.mark.slow
def test_barrier_in_the_interpreter() -> None:
    """The barrier's own kernels, in the interpreter (which runs programs one after
    another, so only a one-program barrier can complete there; the oracle with many
    programs runs on a GPU, test_gpu_barrier_oracle):

    - one program, 3 rounds: it sees its own id after every barrier;
    - 4 programs: the first waits its whole timeout (20 polls here), aborts the launch,
      and the 3 after it stop at their first look instead of waiting out their own;
    - 4 programs that each abort twice: the abort flag reads 1 and no wait polls (a flag
      raised by adding 2**30 would have wrapped round to 0 and let them wait)."""
    pytest.importorskip("triton")
    result = _run_check("barrier", {"device": "cpu"}, timeout=300, env={"TRITON_INTERPRET": "1"})
    assert result["one"] == {"missing": [0], "polls": [0], "aborted": 0}
    assert result["four"] == {"missing": [0, 0, 0, 0], "polls": [20, 0, 0, 0], "aborted": 1}
    assert result["abort"] == {"status": 1, "polls": [0, 0, 0, 0]}


@pytest.mark.parametrize(
    ("seconds", "ns"),
    [pytest.param(1.0, 1_000_000_000, id="1s"), pytest.param(20e-6, 20_000, id="20us")],
)
def test_barrier_timeout_is_wall_clock(seconds: float, ns: int) -> None:
    """KernelConfig.timeout_s reaches the kernels as ns of the GPU's global timer."""
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import launch

    assert launch._timeout_ns(KernelConfig(16, 8, timeout_s=seconds)) == ns


@pytest.mark.parametrize("block_b", [pytest.param(8, id="8"), pytest.param(24, id="24")])
def test_tiles_need_a_power_of_two_of_at_least_16_rows(block_b: int) -> None:
    with pytest.raises(ValueError, match="block_b must be 1 or a power of two >= 16"):
        KernelConfig(block_h=16, num_warps=8, block_b=block_b)


@pytest.mark.parametrize(
    ("config", "dtype", "message"),
    [
        pytest.param(KernelConfig(16, 8, 16), torch.float32, "need bf16 or fp16", id="fp32"),
        pytest.param(KernelConfig(8, 8, 16), torch.bfloat16, "block_h >= 16", id="block_h-8"),
    ],
)
def test_tiles_refuse_what_tensor_cores_cannot_run(config, dtype, message: str) -> None:
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import PersistentKernelError, launch

    with pytest.raises(PersistentKernelError, match=message):
        launch._tiling(config, 1024, dtype)


def test_tiles_are_candidates_only_for_16_bit_weights() -> None:
    rows_only = capacity.candidates(1024, 2, 132)
    with_tiles = capacity.candidates(1024, 2, 132, tiles=True)
    assert [c.block_b for c in rows_only] == [1, 1]
    assert with_tiles[:2] == rows_only  # rows first for a large batch: one product a row
    assert [(c.block_h, c.block_b) for c in with_tiles[2:]] == [(16, 16), (16, 16)]
    assert capacity.candidates(512, 2, 132, tiles=True)[2].block_h == 16  # never below 16
    small_batch = capacity.candidates(1024, 2, 132, tiles=True, tiles_first=True)
    assert small_batch == with_tiles[2:] + rows_only  # one tile holds the whole batch
    assert capacity.candidates(1024, 2, 132, tiles_first=True) == rows_only  # fp32: no tiles


# ---- choosing a configuration and falling back (the host side, with a stand-in GPU) ----

# What torch reports for an H100 SXM (the fields `capacity` and `launch` read).
H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3",
    multi_processor_count=132,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    shared_memory_per_multiprocessor=233472,
)


@pytest.mark.parametrize(
    ("n_regs", "num_warps", "shared", "per_sm"),
    [
        pytest.param(254, 8, 4096, 1, id="rows-8-warps-all-registers"),
        pytest.param(128, 16, 2048, 1, id="rows-16-warps"),
        pytest.param(64, 4, 0, 8, id="small-by-registers"),
        pytest.param(16, 4, 0, 16, id="small-by-threads"),
        pytest.param(40, 4, 100_000, 2, id="by-shared-memory"),
        pytest.param(161, 8, 163_840, 1, id="tiles-gru-1024"),
    ],
)
def test_resident_blocks(n_regs: int, num_warps: int, shared: int, per_sm: int) -> None:
    assert capacity.resident_blocks(n_regs, num_warps, shared, H100) == per_sm


def _compiled(n_regs: int, n_spills: int = 0, num_warps: int = 8, shared: int = 4096):
    """What `kernel.warmup` returns, as far as the resource check reads it."""
    metadata = SimpleNamespace(num_warps=num_warps, shared=shared)
    return SimpleNamespace(_init_handles=lambda: None, n_regs=n_regs, n_spills=n_spills,
                           metadata=metadata)  # fmt: skip


@pytest.mark.parametrize(
    ("compiled", "programs", "message"),
    [
        pytest.param(_compiled(255, n_spills=128), 64, "128 register spills", id="spills"),
        pytest.param(_compiled(254), 133, "133 programs but only 1 per SM x 132", id="grid"),
        pytest.param(_compiled(100), 265, "only 2 per SM", id="grid-2-per-sm"),
        pytest.param(_compiled(254), 132, None, id="one-per-sm"),
        pytest.param(_compiled(100), 264, None, id="two-per-sm"),
    ],
)
def test_a_launch_needs_its_weights_on_chip_and_its_grid_resident(
    compiled, programs: int, message: str | None, monkeypatch
) -> None:
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import PersistentKernelError, launch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H100)
    if message is None:
        launch._check_resources(compiled, programs, torch.device("cuda", 0))
    else:
        with pytest.raises(PersistentKernelError, match=message):
            launch._check_resources(compiled, programs, torch.device("cuda", 0))


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """An H100 as `plan` sees it; `launch.check` (the compile on the GPU) fails for the
    configurations in the returned set, and records every one it is asked about."""
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import PersistentKernelError, launch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H100)
    failing, tried = set(), []

    def check(cell, dtype, hidden, directions, cfg, device) -> None:
        tried.append(cfg)
        if cfg in failing:
            raise PersistentKernelError(f"{cfg.num_warps * 8} register spills")

    monkeypatch.setattr(launch, "check", check)
    function.plan.cache_clear()
    yield failing, tried
    function.plan.cache_clear()


def test_plan_takes_the_first_configuration_that_fits(stand_in_gpu) -> None:
    failing, tried = stand_in_gpu
    rows_8, rows_16, tiles_8, _ = capacity.candidates(1024, 2, 132, tiles=True)
    failing.update({rows_8, rows_16})
    assert function.plan("gru", 1024, torch.bfloat16, 2, 0) == tiles_8
    assert tried == [rows_8, rows_16, tiles_8]
    tried.clear()
    assert isinstance(function.plan("gru", 1024, torch.float32, 2, 0), str)
    assert tried == [rows_8, rows_16]  # float32: no tiles to try


def test_plan_tries_tiles_first_for_a_batch_one_tile_holds(stand_in_gpu) -> None:
    failing, tried = stand_in_gpu
    rows_8, rows_16, tiles_8, tiles_16 = capacity.candidates(1024, 2, 132, tiles=True)
    assert function.plan("gru", 1024, torch.bfloat16, 2, 0, True) == tiles_8
    failing.update({tiles_8, tiles_16})
    function.plan.cache_clear()
    assert function.plan("gru", 1024, torch.bfloat16, 2, 0, True) == rows_8
    assert tried == [tiles_8, tiles_8, tiles_16, rows_8]


@pytest.mark.parametrize(
    ("rows", "tiles_first"),
    [pytest.param(1, False, id="B1"), pytest.param(2, True, id="B2"),
     pytest.param(16, True, id="B16"), pytest.param(17, False, id="B17")],
)  # fmt: skip
def test_choose_asks_for_tiles_first_from_2_to_16_rows(rows: int, tiles_first: bool, monkeypatch):
    """A single row runs fastest as rows, 2 to 16 as one tile (bench/persistent_rnn.py
    on an H200: function.TILES_FIRST_MIN_ROWS)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    asked = []
    monkeypatch.setattr(function, "plan", lambda *key: asked.append(key) or KernelConfig(16, 8))
    monkeypatch.setattr(function, "_broken", set())
    function.choose("persistent", "gru", 1024, _on_gpu(), 2, rows)
    assert asked == [("gru", 1024, torch.bfloat16, 2, 0, tiles_first)]


def test_plan_says_why_nothing_fits(stand_in_gpu) -> None:
    failing, _ = stand_in_gpu
    failing.update(capacity.candidates(2048, 2, 132, tiles=True))
    reason = function.plan("gru", 2048, torch.float16, 2, 0)
    assert reason == (
        "8 warps: PersistentKernelError: 64 register spills; "
        "16 warps: PersistentKernelError: 128 register spills; "
        "8 warps, 16-row tiles: PersistentKernelError: 64 register spills; "
        "16 warps, 16-row tiles: PersistentKernelError: 128 register spills"
    )
    assert function.plan("gru", 1024, torch.float64, 2, 0) == "torch.float64 is not a kernel dtype"
    assert function.plan("rnn", 8192, torch.bfloat16, 1, 0) == "hidden size 8192 > 4096"


BF16, FP32 = torch.bfloat16, torch.float32


def _on_gpu(dtype=torch.bfloat16):
    """A layer input as `choose` reads it: on a CUDA device, with a dtype."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype)


@pytest.mark.parametrize(
    ("cell", "directions", "tiles", "most"),
    [
        pytest.param("gru", 2, True, 16, id="bigru-tiles"),
        pytest.param("gru", 1, True, 16, id="gru-tiles"),
        pytest.param("rnn", 2, True, 16, id="birnn-tiles"),
        pytest.param("rnn", 1, True, 4, id="rnn-tiles-cudnn-persists"),
        pytest.param("gru", 2, False, 4, id="bigru-fp32-rows"),
    ],
)
def test_auto_stops_where_cudnn_was_measured_faster(cell, directions, tiles, most) -> None:
    """bench/persistent_rnn.py on an H200: one direction of a plain RNN is where cuDNN's
    own persistent algorithm wins from 8 rows; rows alone lose from 16 rows."""
    assert function.auto_max_rows(cell, directions, tiles) == most


@pytest.mark.parametrize(
    ("impl", "capability", "rows", "dtype", "fits", "chosen"),
    [
        pytest.param("cudnn", (9, 0), 4, BF16, True, False, id="cudnn"),
        pytest.param("auto", (9, 0), 16, BF16, True, True, id="auto-hopper-16-rows"),
        pytest.param("auto", (9, 0), 17, BF16, True, False, id="auto-hopper-17-rows"),
        pytest.param("auto", (9, 0), 4, FP32, True, True, id="auto-fp32-4-rows"),
        pytest.param("auto", (9, 0), 5, FP32, True, False, id="auto-fp32-5-rows"),
        pytest.param("auto", (8, 0), 4, BF16, True, False, id="auto-ampere"),
        pytest.param("auto", (9, 0), 4, BF16, False, False, id="auto-too-large"),
        pytest.param("persistent", (8, 0), 64, BF16, True, True, id="persistent-ampere"),
        pytest.param("persistent", (9, 0), 4, BF16, False, False, id="persistent-too-large"),
    ],
)  # fmt: skip
def test_choose(
    impl, capability, rows: int, dtype, fits: bool, chosen: bool, monkeypatch, recwarn
) -> None:
    """`auto` takes the kernels where bench/persistent_rnn.py measured them faster than
    cuDNN on an H200: up to 16 rows with 16-bit weights (tiles), 4 in float32 (rows)."""
    cfg = KernelConfig(16, 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(function, "plan", lambda *key: cfg if fits else "16 warps: it spills")
    monkeypatch.setattr(function, "_warned", set())
    got = function.choose(impl, "gru", 1024, _on_gpu(dtype), 2, rows)
    assert got == (("triton", cfg) if chosen else None)
    function.choose(impl, "gru", 1024, _on_gpu(dtype), 2, rows)
    said = [str(w.message) for w in recwarn]
    if impl == "persistent" and not fits:  # asked for and refused: said once, not per step
        assert said == [
            "persistent kernels do not fit gru H=1024 torch.bfloat16 x2: 16 warps: it spills;"
            " using cuDNN"
        ]
    else:
        assert said == []


def test_choose_runs_the_modules_on_the_cpu_and_after_a_failure(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(function, "plan", lambda *key: KernelConfig(16, 8))
    monkeypatch.setattr(function, "_broken", set())
    assert function.choose("persistent", "gru", 1024, torch.zeros(2, 3, 4), 2, 2) is None
    assert function.choose("persistent", "gru", 1024, _on_gpu(), 2, 2) is not None
    function._broken.add(("gru", 1024, torch.bfloat16, 2, 0))
    assert function.choose("persistent", "gru", 1024, _on_gpu(), 2, 2) is None
    assert function.choose("persistent", "gru", 1024, _on_gpu(torch.float32), 2, 2) is not None


@pytest.fixture
def failing_launch(monkeypatch):
    """The tiny model with rnn_impl=persistent, whose every launch fails as a barrier
    timeout does (the seam: `recurrences`; `choose` stands in a GPU that picks the
    kernels). Returns the model, its input, what the modules compute, and the launches."""
    from echoic.model.nn.persistent import PersistentKernelError

    torch.manual_seed(0)
    model = DeepSpeech2(dataclasses.replace(TINY, chunk_frames=4, context_frames=2)).eval()
    feats, lengths = torch.randn(2, 30, 20), torch.tensor([30, 22])
    with torch.no_grad():
        expected, _ = model(feats, lengths)
    launches = []

    def timed_out(*args, **kwargs):
        launches.append(args[0])
        raise PersistentKernelError("persistent forward launch timed out at its grid barrier")

    monkeypatch.setattr(function, "choose", lambda *args: ("triton", KernelConfig(16, 8)))
    monkeypatch.setattr(function, "recurrences", timed_out)
    monkeypatch.setattr(function, "_key", lambda cell, hidden, x, directions: (cell, hidden))
    monkeypatch.setattr(function, "_broken", set())
    monkeypatch.setattr(function, "_warned", set())
    model.set_rnn_impl("persistent")
    return model, (feats, lengths), expected, launches


def test_a_failed_launch_falls_back_to_the_modules(failing_launch, recwarn) -> None:
    """A launch that fails (a barrier timeout, say) costs no result: the layer runs on
    the modules (cuDNN on a GPU), says so once, and its shape is not tried again."""
    model, inputs, expected, launches = failing_launch
    with torch.no_grad():
        got = [model(*inputs)[0] for _ in range(2)]
    assert all(torch.equal(g, expected) for g in got)
    assert len(launches) == 2 * TINY.rnn_layers  # choose is replaced: every layer tries
    assert function._broken == {("gru", TINY.rnn_hidden)}
    assert [str(w.message) for w in recwarn] == [
        "persistent forward launch timed out at its grid barrier;"
        " this layer shape uses cuDNN from now on"
    ]


class _RefusedKernel:
    """A Triton kernel as `launch._launch` calls it, whose compile (`warmup`) or launch
    raises what Triton and the driver raise; the seam: no GPU here."""

    def __init__(self, compile_error: Exception | None, launch_error: Exception | None):
        self.compile_error, self.launch_error, self.launches = compile_error, launch_error, 0

    def warmup(self, *args, grid, **options):
        if self.compile_error is not None:
            raise self.compile_error
        return SimpleNamespace(hash="stand-in")

    def __getitem__(self, grid):
        def run(*args, **options):
            self.launches += 1
            assert options["launch_cooperative_grid"] is True
            if self.launch_error is not None:
                raise self.launch_error

        return run


COOPERATIVE_REFUSED = RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")


@pytest.mark.parametrize(
    ("compile_error", "launch_error", "reason"),
    [
        pytest.param(
            None,
            COOPERATIVE_REFUSED,
            "RuntimeError: Triton Error [CUDA]: too many blocks in cooperative launch",
            id="cooperative-launch-refused",
        ),
        pytest.param(
            ValueError("out of resource: shared memory, Required: 300000, Hardware limit: 232448"),
            None,
            "ValueError: out of resource: shared memory",
            id="compile-fails",
        ),
        pytest.param(
            None,
            RuntimeError("CUDA error: an illegal memory access was encountered"),
            "RuntimeError: CUDA error: an illegal memory access",
            id="launch-fails",
        ),
    ],
)
def test_every_launch_failure_is_a_persistent_kernel_error(
    compile_error, launch_error, reason: str, monkeypatch
) -> None:
    """What Triton or the driver raises when a persistent kernel cannot run becomes
    PersistentKernelError with the reason, which `auto` falls back on; a plain
    RuntimeError would end the training run instead."""
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import PersistentKernelError, launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_check_resources", lambda compiled, programs, device: None)
    kernel = _RefusedKernel(compile_error, launch_error)
    with pytest.raises(PersistentKernelError) as raised:
        launch._launch(kernel, 132, [torch.zeros(1)], {}, KernelConfig(8, 8), persistent=True)
    assert str(raised.value).startswith(f"persistent launch of 132 programs failed: {reason}")
    assert raised.value.__cause__ is (compile_error or launch_error)


def test_a_resource_refusal_keeps_its_own_words(monkeypatch) -> None:
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import PersistentKernelError, launch

    def too_large(compiled, programs, device) -> None:
        raise PersistentKernelError(f"{programs} programs but only 1 per SM x 132 SMs")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_check_resources", too_large)
    kernel = _RefusedKernel(None, None)
    with pytest.raises(PersistentKernelError, match="^133 programs but only 1 per SM x 132 SMs$"):
        launch._launch(kernel, 133, [torch.zeros(1)], {}, KernelConfig(8, 8), persistent=True)
    assert kernel.launches == 0


def test_auto_falls_back_when_the_driver_refuses_a_cooperative_launch(monkeypatch, recwarn) -> None:
    """rnn_impl=auto through the real autograd function and launch code, with only the
    kernel object standing in (the driver refuses its cooperative launch): the model
    gives the modules' result, says why once, and does not try the shape again."""
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import kernels, launch

    torch.manual_seed(0)
    model = DeepSpeech2(dataclasses.replace(TINY, chunk_frames=4, context_frames=2)).eval()
    feats, lengths = torch.randn(2, 30, 20), torch.tensor([30, 22])
    with torch.no_grad():
        expected, _ = model(feats, lengths)
    kernel = _RefusedKernel(None, COOPERATIVE_REFUSED)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "recurrence_forward_kernel", kernel)
    monkeypatch.setattr(launch, "_check_resources", lambda compiled, programs, device: None)
    chosen = []
    monkeypatch.setattr(
        function, "choose", lambda *args: chosen.append(args) or ("triton", KernelConfig(16, 8))
    )
    monkeypatch.setattr(function, "_key", lambda cell, hidden, x, directions: (cell, hidden))
    monkeypatch.setattr(function, "_broken", set())
    monkeypatch.setattr(function, "_warned", set())
    model.set_rnn_impl("auto")
    with torch.no_grad():
        got, _ = model(feats, lengths)
    assert torch.equal(got, expected)
    assert kernel.launches == TINY.rnn_layers
    assert function._broken == {("gru", TINY.rnn_hidden)}
    assert [str(w.message) for w in recwarn] == [
        "persistent launch of 2 programs failed: RuntimeError: Triton Error [CUDA]: too many"
        " blocks in cooperative launch; this layer shape uses cuDNN from now on"
    ]


def test_strict_mode_raises_where_a_failed_launch_would_fall_back(
    failing_launch, monkeypatch, recwarn
) -> None:
    from echoic.model.nn.persistent import PersistentKernelError

    model, inputs, _, launches = failing_launch
    monkeypatch.setenv(STRICT, "1")
    with torch.no_grad(), pytest.raises(PersistentKernelError) as raised:
        model(*inputs)
    assert str(raised.value) == (
        "persistent forward launch timed out at its grid barrier"
        " (ECHOIC_PERSISTENT_STRICT=1: no fallback)"
    )
    assert len(launches) == 1  # the first layer's, and no other
    assert function._broken == set()  # nothing to remember: every failure raises
    assert len(recwarn) == 0


@pytest.mark.parametrize(
    ("impl", "on_gpu", "fits", "raises"),
    [
        pytest.param("persistent", True, True, None, id="persistent-fits"),
        pytest.param(
            "persistent",
            True,
            False,
            "persistent kernels do not fit gru H=1024 torch.bfloat16"
            " x2: 8 warps, 16-row tiles: PersistentKernelError: 64 register spills;",
            id="persistent-does-not-fit",
        ),
        pytest.param(
            "persistent",
            False,
            True,
            "the persistent kernels run on a CUDA GPU, not on cpu",
            id="persistent-on-the-cpu",
        ),
        pytest.param("auto", True, False, None, id="auto-does-not-fit-is-no-fallback"),
        pytest.param("cudnn", True, True, None, id="cudnn"),
    ],
)
def test_strict_mode_raises_where_choose_would_fall_back(
    impl, on_gpu: bool, fits: bool, raises: str | None, stand_in_gpu, monkeypatch, recwarn
) -> None:
    """Where `persistent` would run the modules (kernels that do not fit, a tensor off
    the GPU), strict mode raises; `auto` choosing cuDNN by its policy is no fallback."""
    from echoic.model.nn.persistent import PersistentKernelError

    failing, _ = stand_in_gpu
    if not fits:
        failing.update(capacity.candidates(1024, 2, 132, tiles=True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(STRICT, "1")
    x = _on_gpu() if on_gpu else torch.zeros(2, 3, 4)
    if raises is None:
        got = function.choose(impl, "gru", 1024, x, 2, 4)
        assert (got is not None) == (fits and impl != "cudnn")
    else:
        with pytest.raises(PersistentKernelError) as raised:
            function.choose(impl, "gru", 1024, x, 2, 4)
        assert str(raised.value).startswith(raises)
        assert str(raised.value).endswith(" (ECHOIC_PERSISTENT_STRICT=1: no fallback)")
    assert len(recwarn) == 0


@pytest.mark.parametrize(
    ("strict", "modes", "said"),
    [
        pytest.param(
            "0",
            ["persistent", "steps"],
            [
                "persistent backward launch timed out at its grid barrier;"
                " backward runs one launch per step"
            ],
            id="lenient-finishes-one-launch-per-step",
        ),
        pytest.param("1", ["persistent"], [], id="strict-raises"),
    ],
)
def test_a_failed_persistent_backward(
    strict: str, modes: list, said: list, monkeypatch, recwarn
) -> None:
    """The forward pass ran on the kernels and the persistent backward launch fails: it
    finishes on the barrier-free launches and the layer shape is not tried again (the next
    step runs cuDNN, as after a failed forward launch), or in strict mode raises."""
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import PersistentKernelError, launch

    tried = []
    # Stand-ins for what backward reads of the layer (a GPU tensor's device, the weights'
    # compute dtype): the seam is launch.backward, replaced below.
    dirs = [SimpleNamespace(w=torch.zeros(3, 16, 16, dtype=torch.bfloat16)) for _ in range(2)]
    douts = [SimpleNamespace(device=torch.device("cuda", 0))] * 2

    def backward(cell, clip, dirs, douts, states, mode, cfg):  # the seam: no GPU here
        tried.append(mode)
        if mode == "persistent":
            raise PersistentKernelError("persistent backward launch timed out at its grid barrier")
        return ["the per-step result"]

    monkeypatch.setattr(launch, "backward", backward)
    monkeypatch.setattr(function, "_warned", set())
    monkeypatch.setattr(function, "_broken", set())
    monkeypatch.setattr(function, "plan", lambda *key: KernelConfig(16, 8))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(STRICT, strict)
    spec = function._Spec("gru", float("inf"), "triton", KernelConfig(16, 8), (False, True), True)
    if strict == "1":
        with pytest.raises(PersistentKernelError, match=r"barrier \(ECHOIC_PERSISTENT_STRICT=1"):
            function._backward(spec, dirs, douts, [])
        assert function._broken == set()  # strict: every failure raises, none is remembered
    else:
        assert function._backward(spec, dirs, douts, []) == ["the per-step result"]
        assert function._broken == {("gru", 16, torch.bfloat16, 2, 0)}
        # the next step: `choose` runs this layer shape on the modules
        assert function.choose("auto", "gru", 16, _on_gpu(torch.bfloat16), 2, 4) is None
    assert tried == modes
    assert [str(w.message) for w in recwarn] == said


@pytest.mark.parametrize("value", [pytest.param("true", id="true"), pytest.param("2", id="2")])
def test_strict_mode_is_0_or_1(value: str, monkeypatch) -> None:
    """A misspelt setting must not leave a run silently lenient."""
    monkeypatch.setenv(STRICT, value)
    with pytest.raises(ValueError, match=f"ECHOIC_PERSISTENT_STRICT must be 0 or 1, not '{value}'"):
        function.strict()


@pytest.mark.parametrize(
    ("strict", "outcome"),
    [
        pytest.param("0", {"fell_back": True}, id="lenient-passes"),
        pytest.param("1", None, id="strict-fails-the-check"),
    ],
)
def test_a_fallback_in_a_check_process(strict: str, outcome: dict | None) -> None:
    """The checks run in their own processes, where pytest's filterwarnings=error does
    not reach: a fallback there only warns, and its results are the modules' own. Under
    `_run_check` (strict unless told otherwise) the same fallback fails the check."""
    pytest.importorskip("triton")
    if outcome is not None:
        assert _run_check("model-fallback", {}, timeout=120, env={STRICT: strict}) == outcome
    else:
        with pytest.raises(AssertionError, match=r"stand-in: the launch failed \(ECHOIC_PERS"):
            _run_check("model-fallback", {}, timeout=120)


# ---- sm_90, compiled offline ---------------------------------------------------------

EDGES = [
    pytest.param(cell, dtype, dirs, id=f"{cell}-{dtype}-x{dirs}")
    for cell in ("rnn", "gru")
    for dtype in ("bf16", "fp32")
    for dirs in (1, 2)
]
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sm90_resources(cell: str, dtype: torch.dtype, hidden: int, directions: int, cfg) -> list:
    """`launch.compile_for_target` for sm_90. Skips only where there is no ptxas binary;
    ptxas rejecting the PTX (ours, so our bug) fails."""
    from triton.backends.nvidia.compiler import get_ptxas

    from echoic.model.nn.persistent import launch

    try:
        get_ptxas(90)
    except RuntimeError as e:  # Triton's "Cannot find ptxas-blackwell": none that runs
        pytest.skip(f"no ptxas binary for sm_90: {e}")
    try:
        return launch.compile_for_target(cell, dtype, hidden, directions, cfg)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"ptxas rejected the PTX of {cell} H={hidden} x{directions} {cfg}: {e.stderr}")


@pytest.mark.parametrize("directions", [1, 2])
def test_a_launch_compiles_the_kernel_that_check_proved(directions: int) -> None:
    """`launch.check` compiles with placeholder sizes (2 rows, 2 steps, a timeout of
    1 ns); a launch passes the real ones. Triton compiles a variant per integer value
    class (1, a multiple of 16, other), so every integer argument but H must be left
    unspecialised, or the check proves a variant that is never launched (on an H200 the
    checked one fitted and the launched one spilled)."""
    pytest.importorskip("triton")
    from echoic.model.nn.persistent import launch

    programs = KernelConfig(8, 8).programs(64, directions)
    compiled = launch._placeholders("gru", torch.float32, 64, directions, "cpu", programs)
    for kernel, args, _ in compiled:
        ints = {n for n, a in zip(kernel.arg_names, args, strict=False) if type(a) is int}
        loose = {p.name for p in kernel.params if p.do_not_specialize}
        assert ints - {"H"} <= loose, (kernel.fn.__name__, sorted(ints - {"H"} - loose))
        assert "H" in ints and "H" not in loose  # the same H everywhere: keep its alignment


@pytest.mark.parametrize(
    ("absent", "outcome", "message"),
    [
        pytest.param(True, pytest.skip.Exception, "no ptxas binary for sm_90", id="no-ptxas-skips"),
        pytest.param(False, pytest.fail.Exception, "ptxas rejected the PTX", id="rejection-fails"),
    ],
)
def test_only_a_missing_ptxas_skips_the_sm90_compiles(
    absent: bool, outcome, message: str, monkeypatch
) -> None:
    pytest.importorskip("triton")
    from triton.backends.nvidia import compiler

    from echoic.model.nn.persistent import launch

    def get_ptxas(arch: int):  # stand-ins: the seam is the binary, not the compile
        if absent:
            raise RuntimeError("Cannot find ptxas-blackwell")
        return SimpleNamespace(path="/opt/ptxas", version="12.8")

    def rejected(*args):
        raise subprocess.CalledProcessError(255, ["ptxas"], stderr="ptxas fatal : bad PTX")

    monkeypatch.setattr(compiler, "get_ptxas", get_ptxas)
    monkeypatch.setattr(launch, "compile_for_target", rejected)
    with pytest.raises(outcome, match=message):
        _sm90_resources("gru", torch.float32, 512, 2, KernelConfig(8, 8))


@pytest.mark.slow
@pytest.mark.parametrize(("cell", "dtype", "directions"), EDGES)
def test_sm90_fit_table(cell: str, dtype: str, directions: int, record_property) -> None:
    """The largest H in capacity's table compiles without spills; the next one spills."""
    pytest.importorskip("triton")

    limit = capacity.SM90_MAX_HIDDEN[(cell, dtype)][directions - 1]
    larger = [h for h in capacity.SM90_SWEPT_HIDDEN if h > limit]
    for hidden, fits in [(limit, True)] + [(h, False) for h in larger[:1]]:
        usage = {}
        for cfg in capacity.candidates(hidden, directions, capacity.SM90_SMS):
            res = _sm90_resources(cell, TORCH_DTYPES[dtype], hidden, directions, cfg)
            usage[cfg.num_warps] = res
            record_property(
                f"H{hidden}-warps{cfg.num_warps}",
                [(r.kernel, r.n_regs, r.spill_bytes) for r in res],
            )
        clean = [w for w, res in usage.items() if all(r.spill_bytes == 0 for r in res)]
        assert bool(clean) == fits, (hidden, usage)
        assert capacity.sm90_fits(cell, dtype, hidden, directions) == fits
        assert all(r.mma == 0 for res in usage.values() for r in res)  # CUDA cores only
        assert all(r.clock_reads > 0 for res in usage.values() for r in res)  # timeouts: a clock


@pytest.mark.parametrize(
    ("cell", "dtype", "hidden", "directions", "sms", "tiles", "says"),
    [
        pytest.param("gru", "fp32", 1024, 1, 132, False, True, id="h100-sxm-fits"),
        pytest.param("gru", "fp32", 1024, 2, 132, False, False, id="h200-spills"),
        pytest.param("gru", "fp32", 1024, 1, 114, False, None, id="h100-pcie-larger-slices"),
        pytest.param("gru", "fp32", 1024, 2, 114, False, False, id="h100-pcie-spills-too"),
        pytest.param("rnn", "fp32", 1536, 1, 114, False, True, id="h100-pcie-same-block_h"),
        pytest.param("gru", "bf16", 512, 2, 114, True, True, id="h100-pcie-tiles-of-16"),
        pytest.param("gru", "fp32", 1024, 2, 264, False, None, id="more-sms-smaller-slices"),
    ],
)
def test_what_the_sm90_tables_say_for_a_chip(
    cell: str, dtype: str, hidden: int, directions: int, sms: int, tiles: bool, says
) -> None:
    """The tables were compiled for 132 SMs (block_h for 132 programs); other SM counts
    size the programs otherwise (H100 PCIe: 114 SMs)."""
    assert capacity.sm90_expected(cell, dtype, hidden, directions, sms, tiles) is says


TILE_EDGES = [
    pytest.param(cell, dirs, id=f"{cell}-bf16-x{dirs}")
    for cell in ("rnn", "gru")
    for dirs in (1, 2)
]


@pytest.mark.slow
@pytest.mark.parametrize(("cell", "directions"), TILE_EDGES)
def test_sm90_tile_table(cell: str, directions: int, record_property) -> None:
    """Tensor-core tiles: the largest H in the tiles table compiles without spills,
    within an SM's shared memory and with tensor-core instructions; the next does not fit."""
    pytest.importorskip("triton")

    limit = capacity.SM90_MAX_HIDDEN_TILES[(cell, "bf16")][directions - 1]
    larger = [h for h in capacity.SM90_SWEPT_HIDDEN if h > limit]
    for hidden, fits in [(limit, True)] + [(h, False) for h in larger[:1]]:
        usage = {}
        for cfg in capacity.candidates(hidden, directions, capacity.SM90_SMS, tiles=True)[2:]:
            res = _sm90_resources(cell, torch.bfloat16, hidden, directions, cfg)
            usage[cfg.num_warps] = res
            record_property(
                f"H{hidden}-warps{cfg.num_warps}",
                [(r.kernel, r.n_regs, r.spill_bytes, r.shared, r.mma) for r in res],
            )
        clean = [
            w
            for w, res in usage.items()
            if all(r.spill_bytes == 0 and r.shared <= capacity.SM90_SHARED_PER_PROGRAM for r in res)
        ]
        assert bool(clean) == fits, (hidden, usage)
        assert capacity.sm90_fits(cell, "bf16", hidden, directions, tiles=True) == fits
        assert all(r.mma > 0 for res in usage.values() for r in res)  # on the tensor cores
        assert all(r.clock_reads > 0 for res in usage.values() for r in res)


# ---- on a GPU: against cuDNN -----------------------------------------------------------

GPU_SHAPES = [
    pytest.param(cell, hidden, dirs, id=f"{cell}-H{hidden}-x{dirs}")
    for cell in ("rnn", "gru")
    for hidden in (512, 1024, 2048)
    for dirs in (1, 2)
]

# What plan's reasons say when a configuration is too large for a chip (launch's checks,
# Triton's shared-memory check); anything else is a compile or launch error.
RESOURCE_LIMITS = ("register spills", "can be resident at once", "out of resource")


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("triton")


def _check_plan(
    result: dict, cell: str, dtype: str, hidden: int, directions: int, tables=(False,)
) -> bool:
    """Whether a GPU check's `result` ran the kernels (True) or this GPU rightly refused
    them (False).

    The sm_90 tables (`tables`: False the rows table, True the tiles table), read for
    this GPU's SM count (capacity.sm90_expected), must agree where they say anything;
    a refusal must be for resources, not a compile or launch error. Where a shape does
    not fit this GPU and the tables do not say whether it should, skips, saying so.
    """
    expected = None
    if result["capability"] == [9, 0]:
        says = [
            capacity.sm90_expected(cell, dtype, hidden, directions, result["sms"], tiles)
            for tiles in tables
        ]
        expected = True if True in says else False if all(x is False for x in says) else None
    shape = f"{cell} H={hidden} {dtype} x{directions} on {result['device']} ({result['sms']} SMs)"
    refused = result.get("unsupported")
    if refused is None:
        assert expected is not False, f"{shape} ran ({result['config']}): the tables say it spills"
        return True
    assert expected is not True, f"{shape} was refused, but the sm_90 tables say it fits: {refused}"
    for reason in refused.split("; "):
        assert any(limit in reason for limit in RESOURCE_LIMITS), f"{shape}: {refused}"
    if expected is None:
        pytest.skip(
            f"{shape} does not fit, and the sm_90 tables ({capacity.SM90_SMS} SMs) do not say"
            f" whether it should on {result['sms']}: {refused}"
        )
    return False


def _gpu_result(sms: int, unsupported: str | None = None) -> dict:
    """What a GPU check returns about the device and the configuration plan chose."""
    result = {"device": "NVIDIA H100", "sms": sms, "capability": [9, 0]}
    if unsupported is None:
        return {**result, "config": {"block_h": 8, "num_warps": 8}}
    return {**result, "unsupported": unsupported}


SPILLS = (
    "8 warps: PersistentKernelError: 96 register spills (255 registers): the weight slice does"
    " not fit in registers; 16 warps: PersistentKernelError: 8 register spills (128 registers):"
    " the weight slice does not fit in registers"
)


COMPILE_ERROR = "8 warps: CompilationError: at 12:4: invalid operand"


@pytest.mark.parametrize(
    ("directions", "result", "outcome"),
    [
        pytest.param(1, _gpu_result(132), True, id="h100-sxm-runs-a-fit"),
        pytest.param(2, _gpu_result(132, SPILLS), False, id="h200-refuses-a-spill"),
        pytest.param(1, _gpu_result(132, SPILLS), AssertionError, id="h100-sxm-refuses-a-fit"),
        pytest.param(2, _gpu_result(132), AssertionError, id="h200-runs-a-spill"),
        pytest.param(1, _gpu_result(114), True, id="h100-pcie-runs"),
        pytest.param(1, _gpu_result(114, SPILLS), pytest.skip.Exception, id="h100-pcie-unknown"),
        pytest.param(2, _gpu_result(114, SPILLS), False, id="h100-pcie-refuses-a-spill"),
        pytest.param(2, _gpu_result(114, COMPILE_ERROR), AssertionError, id="compile-error"),
    ],
)
def test_gpu_checks_judge_a_refusal_by_the_gpus_sm_count(
    directions: int, result: dict, outcome
) -> None:
    """`_check_plan`, with which the GPU tests judge plan's choice, on stand-in results
    for a GRU with H = 1024 in fp32: with 132 SMs it fits one direction, not two; with
    114 each program holds twice the weights (block_h 16 and 32 instead of 8 and 16),
    so the table says only that two directions do not fit."""
    if isinstance(outcome, bool):
        assert _check_plan(result, "gru", "fp32", 1024, directions) is outcome
    else:
        with pytest.raises(outcome):
            _check_plan(result, "gru", "fp32", 1024, directions)


@pytest.mark.gpu
@pytest.mark.parametrize(("cell", "hidden", "directions"), GPU_SHAPES)
def test_gpu_kernels_equal_cudnn_fp32(cell: str, hidden: int, directions: int) -> None:
    """Forward and all gradients, T in {1, 7, 700}, B in {1, 3, 4, 16, 64}, against the
    same modules in float64; shapes that do not fit must be refused (and match the table).

    The kernels' outputs are within 1e-4 of float64. Their gradients are within 1e-3 of
    it, or no further from it than twice cuDNN's own float32 gradients are: a ReLU's
    gradient jumps where a pre-activation crosses 0, and over 700 steps x 64 rows x H
    units some pre-activations lie within float32 rounding of 0, so any two float32
    summation orders (cuDNN's included) disagree there by a whole unit's gradient
    ("flips", counted against float64 in the result)."""
    _need_gpu()
    args = dict(cell=cell, hidden=hidden, directions=directions)
    result = _run_check("gpu", args, timeout=600)
    if not _check_plan(result, cell, "fp32", hidden, directions):
        return
    for case, errors in result["errors"].items():
        kernels, cudnn = errors["persistent"], errors["cudnn"]
        assert kernels["out"] < 1e-4, (case, errors)
        assert kernels["grad"] < max(1e-3, 2 * cudnn["grad"]), (case, errors)
    print(result)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [pytest.param(512, id="H512"), pytest.param(1024, id="H1024")])
def test_gpu_bf16_autocast_as_close_to_fp32_as_cudnn(hidden: int) -> None:
    """A BiGRU under bf16 autocast, with the configuration plan picks (rows or tiles);
    H = 512 fits every Hopper part, H = 1024 the 132-SM ones."""
    _need_gpu()
    result = _run_check("gpu-bf16", {"hidden": hidden}, timeout=600)
    if not _check_plan(result, "gru", "bf16", hidden, 2, tables=(False, True)):
        return
    for kernels, cudnn in zip(result["persistent"], result["cudnn"], strict=True):
        assert _within_bf16(kernels, cudnn), result
    print(result)


TILE_SHAPES = [
    pytest.param("gru", 512, 2, id="gru-H512-x2"),  # fits with 114 SMs too
    pytest.param("gru", 1024, 2, id="gru-H1024-x2"),
    pytest.param("rnn", 1024, 2, id="rnn-H1024-x2"),
    pytest.param("rnn", 2048, 1, id="rnn-H2048-x1"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("cell", "hidden", "directions"), TILE_SHAPES)
def test_gpu_tiles_as_close_to_fp32_as_cudnn(cell: str, hidden: int, directions: int) -> None:
    """Tensor-core tiles under bf16 autocast, T in {1, 7, 700}, B in {1, 4, 16, 20, 64}
    (one, two and four tiles): outputs and gradients against float32 cuDNN, no further
    off than cuDNN under the same autocast."""
    _need_gpu()
    args = dict(cell=cell, hidden=hidden, directions=directions)
    result = _run_check("gpu-tiles", args, timeout=600)
    if not _check_plan(result, cell, "bf16", hidden, directions, tables=(True,)):
        return
    for case, errors in result["errors"].items():
        for kernels, cudnn in zip(errors["persistent"], errors["cudnn"], strict=True):
            assert _within_bf16(kernels, cudnn), (case, errors)
    print(result)


@pytest.mark.gpu
def test_gpu_refuses_what_cannot_run() -> None:
    """A grid that cannot be co-resident is refused before launch; a barrier that
    cannot complete (timeout 0) times out, flags it and raises."""
    _need_gpu()
    result = _run_check("gpu-refusals", {}, timeout=600)
    assert result["too_large"].startswith("PersistentKernelError: 8192 programs but only"), result
    assert result["too_large"].endswith("can be resident at once"), result
    assert result["timeout"] == (
        "PersistentKernelError: persistent forward launch timed out at its grid barrier"
        " (programs not co-resident?)"
    )


@pytest.mark.gpu
def test_gpu_barrier_oracle() -> None:
    """One program per SM (co-resident, a cooperative launch), 200 rounds: after each
    barrier every program reads every other program's id for the round, one program a
    round arriving 2 us late; and 132 programs that all abort at once leave the flag at 1."""
    _need_gpu()
    result = _run_check("barrier", {"device": "cuda"}, timeout=300)
    programs = result["sms"]
    assert result["oracle"]["aborted"] == 0, result
    assert result["oracle"]["missing"] == [0] * programs, result
    assert result["abort"] == {"status": 1, "polls": [0] * programs}, result


@pytest.mark.gpu
def test_gpu_training_step_matches_cudnn() -> None:
    """A 3-layer BiGRU model's loss and gradients, rnn_impl persistent and cudnn, each
    against float64; every layer's forward and backward is one persistent launch
    (counted: a layer that quietly ran cuDNN would match it exactly)."""
    _need_gpu()
    result = _run_check("gpu-train-step", {}, timeout=600)
    assert result["launches"] == {
        "cudnn": {"forward": 0, "backward": 0},
        "persistent": {"forward": 3, "backward": 3},
    }
    assert abs(result["persistent"] - result["float64"]) <= 1e-3 * abs(result["float64"])
    # Both float32 gradients against float64: the kernels' no further than 1e-2, or than
    # twice cuDNN's own distance.
    errors = result["grad_vs_float64"]
    assert errors["persistent"] < max(1e-2, 2 * errors["cudnn"]), result
    print(result)


# ---- the checks that run in a fresh interpreter ------------------------------------------


def _run_check(check: str, args: dict, timeout: int, env: dict | None = None) -> dict:
    """Run a check in a fresh interpreter, strict (a fallback raises) unless `env` says."""
    full_env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", STRICT: "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_persistent_rnn", check, json.dumps(args)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_no_triton(_: dict) -> dict:
    sys.modules["triton"] = None  # an import of triton now raises ImportError
    from echoic.model.nn import network, persistent  # noqa: F401

    try:
        from echoic.model.nn.persistent import launch  # noqa: F401

        launch_result = "imported"
    except ImportError:
        launch_result = "ImportError"
    problems, leaves = _two_problems("gru", d=3, h=4)
    outs = recurrences("gru", problems, backend="reference")
    ok = max(_max_errors(outs, _modules_path(problems), leaves)) < 1e-12
    return {"launch": launch_result, "reference_ok": ok}


def _check_interpreter(args: dict) -> dict:
    kind, dtype, batch = args["kind"], getattr(torch, args["dtype"]), args["batch"]
    problems, leaves = _two_problems(kind, d=5, h=16, dtype=torch.float32, batch=batch, steps=4)
    low = [dataclasses.replace(p, x=p.x.to(dtype)) for p in problems]
    block_h = args["block_h"] or 16  # 0: one program a direction (H = 16)
    config = KernelConfig(block_h, num_warps=4, block_b=args["block_b"])
    outs = recurrences(_cell(kind), low, _clip(kind), args["backend"], config)
    # Against the reference in float64 on the same (rounded) inputs and weights.
    ref_problems = []
    for p in low:
        rnn = _module(kind, 5, 16)
        with torch.no_grad():
            for a, b in zip(rnn.parameters(), p.rnn.parameters(), strict=True):
                a.copy_(b.to(dtype).double())
        ref_problems.append(dataclasses.replace(p, rnn=rnn, x=p.x.double()))
    expected = recurrences(_cell(kind), ref_problems, _clip(kind), "reference")
    ref_leaves = [ref_problems[0].x, ref_problems[1].x]
    ref_leaves += [*ref_problems[0].rnn.parameters(), *ref_problems[1].rnn.parameters()]
    # Gradients w.r.t. x (low precision leaves) and the parameters of both directions.
    torch.manual_seed(1)
    weights = [torch.randn_like(e) for e in expected]
    got = torch.autograd.grad(
        sum((o.double() * w).sum() for o, w in zip(outs, weights, strict=True)),
        [low[0].x, low[1].x, *leaves[3:]],
    )
    want = torch.autograd.grad(
        sum((e * w).sum() for e, w in zip(expected, weights, strict=True)), ref_leaves
    )

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()

    return {
        "out": max(rel(o, e) for o, e in zip(outs, expected, strict=True)),
        "grad": max(rel(a, b) for a, b in zip(got, want, strict=True)),
    }


def _check_timeout(_: dict) -> dict:
    from echoic.model.nn.persistent import PersistentKernelError, launch

    problems, _ = _two_problems("gru", d=5, h=16, dtype=torch.float32, batch=2, steps=3)
    status = {}
    original = launch._raise_on_timeout

    def spy(flag: torch.Tensor, what: str) -> None:
        status["flag"] = int(flag.item())
        original(flag, what)

    launch._raise_on_timeout = spy  # to read the flag the kernel wrote
    try:
        recurrences("gru", problems, backend="triton", config=KernelConfig(4, 4, timeout_s=20e-6))
    except PersistentKernelError:
        return {"error": "PersistentKernelError", "timed_out": status.get("flag") == 1}
    return {"error": None, "timed_out": status.get("flag") == 1}


def _check_barrier(args: dict) -> dict:
    from echoic.model.nn.persistent import launch

    device = args["device"]
    if device == "cpu":  # the interpreter: programs run one after another
        return {
            "one": launch.barrier_oracle(1, 3, device),
            "four": launch.barrier_oracle(4, 3, device, timeout_s=20e-6),
            "abort": launch.barrier_abort(4, device, timeout_s=20e-6),
        }
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {
        "sms": sms,
        "oracle": launch.barrier_oracle(sms, 200, device, delay_ns=2000),
        "abort": launch.barrier_abort(sms, device),
    }


def _fp32_exact() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _device() -> dict:
    """The GPU, as `_check_plan` reads it."""
    props = torch.cuda.get_device_properties(0)
    sms, capability = props.multi_processor_count, [props.major, props.minor]
    return {"device": props.name, "sms": sms, "capability": capability}


def _check_gpu(args: dict) -> dict:
    """The kernels and cuDNN in float32, each against the modules in float64."""
    _fp32_exact()
    cell, hidden, directions = args["cell"], args["hidden"], args["directions"]
    found = function.plan(cell, hidden, torch.float32, directions, 0)
    if isinstance(found, str):
        return {**_device(), "unsupported": found}
    kind = "gru" if cell == "gru" else "relu"
    errors = {}
    for steps in (1, 7, 700):
        for batch in (1, 3, 4, 16, 64):
            problems, leaves = _gpu_problems(kind, 64, hidden, batch, steps, directions)
            exact, exact_leaves = _in_float64(problems, leaves)
            expected = _modules_path(exact)
            measured = {
                "persistent": recurrences(cell, problems, backend="triton", config=found),
                "cudnn": _modules_path(problems),
            }
            errors[f"T{steps}-B{batch}"] = {
                name: _errors_against(outs, leaves, expected, exact_leaves, kind == "relu")
                for name, outs in measured.items()
            }
    return {**_device(), "config": dataclasses.asdict(found), "errors": errors}


def _in_float64(problems: list[Problem], leaves: list[torch.Tensor]):
    """The same problems with float64 copies of every leaf (and so of the modules)."""
    copies = {id(t): t.detach().double().requires_grad_(t.requires_grad) for t in leaves}
    exact = []
    for p in problems:
        rnn = copy.deepcopy(p.rnn).double()
        for ours, theirs in zip(p.rnn.parameters(), rnn.parameters(), strict=True):
            copies[id(ours)] = theirs
        h0 = None if p.h0 is None else copies[id(p.h0)]
        exact.append(dataclasses.replace(p, rnn=rnn, x=copies[id(p.x)], h0=h0))
    return exact, [copies[id(t)] for t in leaves]


def _errors_against(outs, leaves, expected, exact_leaves, relu: bool) -> dict:
    """Relative errors (largest difference over largest value) of float32 outputs and
    gradients against float64 ones, and for a ReLU the activations on the other side
    of 0 than in float64."""
    out_err, grad_err = _max_errors([o.double() for o in outs], expected, leaves, exact_leaves)
    result = {"out": out_err, "grad": grad_err}
    if relu:
        result["flips"] = sum(
            int(((o > 0) != (e > 0)).sum()) for o, e in zip(outs, expected, strict=True)
        )
    return result


def _gpu_problems(kind: str, d: int, h: int, batch: int, steps: int, directions: int):
    """The forward direction from h0, and with two, the backward one over the same
    input reversed within random lengths (the longest row: all steps)."""
    torch.manual_seed(0)
    x = torch.randn(batch, steps, d, device="cuda", requires_grad=True)
    h0 = (0.5 * torch.randn(batch, h, device="cuda")).requires_grad_()
    fwd = _module(kind, d, h, torch.float32, "cuda")
    problems, leaves = [Problem(fwd, x, h0)], [x, h0, *fwd.parameters()]
    if directions == 2:
        bwd = _module(kind, d, h, torch.float32, "cuda")
        lengths = torch.randint(1, steps + 1, (batch,), device="cuda")
        lengths[0] = steps
        problems.append(Problem(bwd, x, None, lengths, reverse=True))
        leaves += list(bwd.parameters())
    return problems, leaves


def _relu_grad_error(problems: list[Problem], leaves: list[torch.Tensor], outs) -> float:
    """The kernels' gradients against float64 ones of the same ReLU recurrences taken at
    the kernels' own activations (each unit on the side of 0 that `outs` put it), with
    `_max_errors`' loss weights. A ReLU's gradient jumps where a pre-activation crosses
    0; rounding (bf16's above all) moves some across, and there a whole unit's gradient
    differs however right the kernels are. Measured this way, the comparison sees the
    kernels' arithmetic, not those jumps."""
    torch.manual_seed(1)
    weights = [torch.randn_like(o, dtype=torch.float32) for o in outs]
    got = torch.autograd.grad(
        sum((o.float() * w).sum() for o, w in zip(outs, weights, strict=True)),
        leaves,
        retain_graph=True,
    )
    want = {id(t): torch.zeros_like(t, dtype=torch.float64) for t in leaves}
    for p, out, w in zip(problems, outs, weights, strict=True):
        n_rows, steps, _ = p.x.shape
        w_ih, w_hh, b_ih, b_hh = (t.detach().double() for t in function.weights(p.rnn))
        hidden = w_hh.shape[1]
        h0 = torch.zeros(n_rows, hidden, dtype=torch.float64, device=p.x.device)
        if p.h0 is not None:
            h0 = p.h0.detach().double().reshape(n_rows, hidden)
        lengths = p.lengths if p.lengths is not None else torch.full((n_rows,), steps)
        lengths = lengths.to(p.x.device)
        order = reference_positions(lengths, steps, p.reverse)
        hs = out.detach().double()
        dgi, dgh, dh0 = reference_backward("rnn", w.double(), hs, None, h0, w_hh, order, 1e30)
        inputs = (p.x.detach().double(), p.h0, None, w_ih, w_hh, b_ih, b_hh)
        grads = function._gemm_grads(
            inputs, (h0, lengths), hs, p.reverse, dgi, dgh, dh0, torch.float64
        )
        for leaf, grad in zip([p.x, p.h0, None, *function.weights(p.rnn)], grads, strict=True):
            if leaf is not None and id(leaf) in want:
                want[id(leaf)] += grad
    return max(
        ((a.double() - want[id(t)]).abs().max() / want[id(t)].abs().max().clamp_min(1e-6)).item()
        for a, t in zip(got, leaves, strict=True)
    )


# How far from float32 the kernels may be under bf16 autocast. They keep what they
# exchange between programs every step (the state forward, dgh backward) and the input
# projections in bf16 (half the bytes; the tiles' tensor cores take bf16 operands
# anyway): 2^-9 relative each, so about 4e-3 from float32 for outputs and 7e-3 for
# gradients (an H200, 2026-11-27), where cuDNN under the same autocast, which keeps its
# state in float32, is at about 5e-4. bf16 training's own tolerance (1e-3 to 1e-2).
BF16_STATE_ERROR = 1e-2


def _within_bf16(kernels: float, cudnn: float) -> bool:
    return kernels <= max(2 * cudnn + 1e-3, BF16_STATE_ERROR)


def _check_gpu_bf16(args: dict) -> dict:
    """Errors against float32 cuDNN of the kernels and of cuDNN, both under bf16 autocast."""
    _fp32_exact()
    hidden = args["hidden"]
    cfg = function.plan("gru", hidden, torch.bfloat16, 2, 0)
    if isinstance(cfg, str):
        return {**_device(), "unsupported": cfg}
    problems, leaves = _two_problems("gru", 64, hidden, torch.float32, "cuda", batch=4, steps=51)
    expected = _modules_path(problems)
    result = {**_device(), "config": dataclasses.asdict(cfg)}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        kernels = recurrences("gru", problems, backend="triton", config=cfg)
        cudnn = _modules_path(problems)
    for name, outs in (("persistent", kernels), ("cudnn", cudnn)):
        result[name] = _max_errors([o.float() for o in outs], expected, leaves)
    return result


def _check_gpu_tiles(args: dict) -> dict:
    _fp32_exact()
    cell, hidden, directions = args["cell"], args["hidden"], args["directions"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = capacity.candidates(hidden, directions, sms, tiles=True)[2:]  # 8, 16 warps
    cfg = function.first_fit(cell, hidden, torch.bfloat16, directions, 0, tiles)
    if isinstance(cfg, str):
        return {**_device(), "unsupported": cfg}
    kind = "gru" if cell == "gru" else "relu"
    errors = {}
    for steps in (1, 7, 700):
        for batch in (1, 4, 16, 20, 64):
            problems, leaves = _gpu_problems(kind, 64, hidden, batch, steps, directions)
            expected = _modules_path(problems)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                kernels = recurrences(cell, problems, backend="triton", config=cfg)
                cudnn = _modules_path(problems)
            own = _relu_grad_error(problems, leaves, kernels) if kind == "relu" else None
            errors[f"T{steps}-B{batch}"] = {
                name: _max_errors([o.float() for o in outs], expected, leaves)
                for name, outs in (("persistent", kernels), ("cudnn", cudnn))
            }
            if own is not None:  # the gradients at the kernels' own activations
                errors[f"T{steps}-B{batch}"]["persistent"] = (
                    errors[f"T{steps}-B{batch}"]["persistent"][0],
                    own,
                )
    return {**_device(), "config": dataclasses.asdict(cfg), "errors": errors}


def _check_gpu_refusals(_: dict) -> dict:
    from echoic.model.nn.persistent import PersistentKernelError

    result = {}
    for name, hidden, cfg in [
        # 8192 programs, without spills (30 registers): an SM holds 4 (2048 threads)
        ("too_large", 4096, KernelConfig(block_h=1, num_warps=16)),
        # 32 programs that fit any chip (72 and 96 registers, no spills), which give up
        # at the first barrier that is not yet complete
        ("timeout", 256, KernelConfig(block_h=16, num_warps=4, timeout_s=0.0)),
    ]:
        problems, _ = _gpu_problems("relu", 16, hidden, batch=2, steps=9, directions=2)
        try:
            recurrences("rnn", problems, backend="triton", config=cfg)
            result[name] = None
        except PersistentKernelError as e:
            result[name] = f"{type(e).__name__}: {e}"
    return result


def _count_launches() -> dict:
    """Persistent launches that returned, forward and backward, counted from now on."""
    from echoic.model.nn.persistent import launch

    counts = {"forward": 0, "backward": 0}

    def counted(name: str):
        run = getattr(launch, name)

        def wrapper(*args):  # function._forward and _backward pass (..., mode, cfg)
            out = run(*args)
            counts[name] += args[-2] == "persistent"
            return out

        return wrapper

    launch.forward, launch.backward = counted("forward"), counted("backward")
    return counts


def _check_gpu_train_step(args: dict) -> dict:
    """A 3-layer BiGRU model's loss and gradients in float32 with rnn_impl cudnn and
    persistent, each against the same model in float64 (on cuDNN's modules)."""
    _fp32_exact()
    device = args.get("device", "cuda")
    # H = 256 (the default recipe's) fits every Hopper part, whatever its SM count.
    cfg = dataclasses.replace(TINY, rnn_hidden=256, rnn_layers=3, chunk_frames=16, context_frames=8)
    losses, grads, launches = {}, {}, {}
    counts = _count_launches()
    for impl, dtype in (("cudnn", torch.float32), ("persistent", torch.float32),
                        ("float64", torch.float64)):  # fmt: skip
        before = dict(counts)
        torch.manual_seed(0)
        model = DeepSpeech2(cfg).to(device, dtype).train()
        model.set_rnn_impl("cudnn" if impl == "float64" else impl)
        torch.manual_seed(1)
        feats = torch.randn(4, 400, 20, device=device).to(dtype)
        lengths = torch.tensor([400, 380, 300, 211], device=device)
        log_probs, out_len = model(feats, lengths)
        ramp = torch.linspace(-1, 1, log_probs.shape[-1], device=device, dtype=dtype)
        loss = (log_probs * ramp).sum()
        grads[impl] = torch.autograd.grad(loss, list(model.parameters()))
        losses[impl] = loss.item()
        launches[impl] = {k: counts[k] - before[k] for k in counts}

    def error(impl: str, against: str) -> float:
        return max(
            ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()
            for a, b in zip(grads[impl], grads[against], strict=True)
        )

    return {
        **losses,
        "grad": error("persistent", "cudnn"),
        "grad_vs_float64": {impl: error(impl, "float64") for impl in ("persistent", "cudnn")},
        "launches": {k: launches[k] for k in ("cudnn", "persistent")},
    }


def _check_model_fallback(_: dict) -> dict:
    """The tiny model with rnn_impl=persistent on the CPU, its launches failing: a
    stand-in `choose` picks the kernels, and launch.forward raises as a barrier timeout
    does (where the mutation check breaks it too)."""
    from echoic.model.nn.persistent import PersistentKernelError, launch

    def fails(*args, **kwargs):
        raise PersistentKernelError("stand-in: the launch failed")

    launch.forward = fails
    function.choose = lambda *args: ("triton", KernelConfig(16, 4))
    function._key = lambda cell, hidden, x, directions: (cell, hidden)  # no CUDA device
    torch.manual_seed(0)
    model = DeepSpeech2(TINY).eval()
    model.set_rnn_impl("persistent")
    with torch.no_grad():
        model(torch.randn(2, 30, 20), torch.tensor([30, 22]))
    return {"fell_back": True}


CHECKS = {
    "no-triton": _check_no_triton,
    "interpreter": _check_interpreter,
    "timeout": _check_timeout,
    "barrier": _check_barrier,
    "gpu": _check_gpu,
    "gpu-bf16": _check_gpu_bf16,
    "gpu-tiles": _check_gpu_tiles,
    "gpu-refusals": _check_gpu_refusals,
    "gpu-train-step": _check_gpu_train_step,
    "model-fallback": _check_model_fallback,
}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]](json.loads(sys.argv[2]))))
