"""The GPU recipes that nothing here can train: they load, and build the network they describe."""

from __future__ import annotations

import re

from echoic.model.nn.network import DeepSpeech2
from echoic.training.train import load_recipe
from tests.conftest import ROOT

LIBRISPEECH = ROOT / "training" / "recipes" / "librispeech.toml"


def test_librispeech_recipe_builds_a_ds2_sized_network() -> None:
    cfg = load_recipe(LIBRISPEECH)
    assert cfg.precision == "bf16" and cfg.model.rnn_layers == 7 and cfg.model.rnn_hidden == 1024
    assert cfg.model.time_stride == 2 and cfg.model.features.mel_bins == 80
    count = sum(p.numel() for p in DeepSpeech2(cfg.model).parameters())
    text = LIBRISPEECH.read_text()
    stated = re.search(r"([\d,]+) parameters", text)
    assert stated and int(stated[1].replace(",", "")) == count  # the comment tells the truth
    assert 60e6 < count < 120e6  # DS2-sized: DS2's English models are up to ~100 M
    assert "UNMEASURED" in text  # until a GPU run replaces the estimates


def test_gpu_mid_recipe_states_its_size() -> None:
    """scripts/gpu_train.sh's default recipe: a 5 x 512 BiGRU whose float32 weights fit
    the six 15 MB parts a device call brings back (docs/training-gpu.md)."""
    recipe = ROOT / "training" / "recipes" / "gpu_mid.toml"
    cfg = load_recipe(recipe)
    assert (cfg.model.rnn_layers, cfg.model.rnn_hidden, cfg.model.bidirectional) == (5, 512, True)
    count = sum(p.numel() for p in DeepSpeech2(cfg.model).parameters())
    stated = re.search(r"([\d,]+) parameters", recipe.read_text())
    assert stated and int(stated[1].replace(",", "")) == count
    assert 4 * count < 6 * 15e6
