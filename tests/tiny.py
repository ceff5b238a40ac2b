"""The tiny network the model tests share: small enough to build in milliseconds."""

from __future__ import annotations

import dataclasses

import torch

from echoic.model.core.features import FeatureConfig
from echoic.model.nn.network import DeepSpeech2, ModelConfig

TINY = ModelConfig(
    features=FeatureConfig(mel_bins=20),
    conv_channels=(4, 4),
    conv_kernel_freq=(5, 3),
    conv_kernel_time=(5, 3),
    conv_stride_freq=(2, 1),
    conv_stride_time=(2, 1),
    rnn_layers=2,
    rnn_hidden=12,
)


def tiny_model(**changes) -> DeepSpeech2:
    """TINY with `changes`, in eval mode, with non-trivial normalisation and batch-norm
    statistics, as after training."""
    torch.manual_seed(0)
    model = DeepSpeech2(dataclasses.replace(TINY, **changes))
    with torch.no_grad():
        model.feature_mean.uniform_(-1, 1)
        model.feature_std.uniform_(0.5, 2)
        for m in model.modules():
            if hasattr(m, "running_mean"):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return model.eval()
