"""The GPU recipes that nothing here can train: they load, and build the network they describe."""

from __future__ import annotations

import re

from echoic.model.nn.network import DeepSpeech2
from echoic.training.train import load_recipe
from tests.conftest import ROOT

LIBRISPEECH = ROOT / "training" / "recipes" / "librispeech.toml"


def _parameters_as_stated(recipe) -> int:
    """The parameter count of the recipe's network, checked against the count its
    comment states ("N parameters")."""
    count = sum(p.numel() for p in DeepSpeech2(load_recipe(recipe).model).parameters())
    stated = re.search(r"([\d,]+) parameters", recipe.read_text())
    assert stated and int(stated[1].replace(",", "")) == count  # the comment tells the truth
    return count


def test_librispeech_recipe_builds_a_ds2_sized_network() -> None:
    cfg = load_recipe(LIBRISPEECH)
    assert cfg.precision == "bf16" and cfg.model.rnn_layers == 7 and cfg.model.rnn_hidden == 1024
    assert cfg.model.time_stride == 2 and cfg.model.features.mel_bins == 80
    count = _parameters_as_stated(LIBRISPEECH)
    assert 60e6 < count < 120e6  # DS2-sized: DS2's English models are up to ~100 M
    assert "UNMEASURED" in LIBRISPEECH.read_text()  # until a GPU run replaces the estimates


def test_gpu_mid_recipe_states_its_size() -> None:
    """scripts/gpu_train.sh's default recipe: a 5 x 512 BiGRU whose float32 weights fit
    the six 15 MB parts a device call brings back (docs/training-gpu.md)."""
    recipe = ROOT / "training" / "recipes" / "gpu_mid.toml"
    cfg = load_recipe(recipe)
    assert (cfg.model.rnn_layers, cfg.model.rnn_hidden, cfg.model.bidirectional) == (5, 512, True)
    assert 4 * _parameters_as_stated(recipe) < 6 * 15e6


def test_gpu_default_recipe_is_the_bundled_front_end_wider() -> None:
    """The bundled model's recipe for a lent GPU (scripts/train_v4.sh): the same features,
    convolutions and chunking as the 3 x 256 recipe it grows from, with a 5 x 320 BiGRU of
    the size its header states."""
    recipe = ROOT / "training" / "recipes" / "gpu_default.toml"
    cfg, base = (
        load_recipe(recipe).model,
        load_recipe(ROOT / "training" / "recipes" / "default.toml").model,
    )
    assert (cfg.rnn_layers, cfg.rnn_hidden) == (5, 320)
    assert cfg.name == base.name == "echoic-en-default"
    same = (
        "features",
        "conv_channels",
        "conv_kernel_freq",
        "conv_kernel_time",
        "conv_stride_freq",
        "conv_stride_time",
        "chunk_frames",
        "context_frames",
        "rnn_type",
    )
    assert all(getattr(cfg, f) == getattr(base, f) for f in same)  # fmt: skip
    _parameters_as_stated(recipe)
