"""The DS2 network: shapes, CTC, and the streaming invariant (chunked == whole)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from echoic.model.nn.network import ctc_loss, stream_utterance
from tests.tiny import TINY, tiny_model

_model = tiny_model


STREAMING = [
    pytest.param(dict(chunk_frames=4, context_frames=2), id="bigru-chunk4-ctx2"),
    pytest.param(dict(chunk_frames=5, context_frames=0), id="bigru-chunk5-noctx"),
    pytest.param(dict(rnn_type="lstm", chunk_frames=3, context_frames=2), id="bilstm-chunk3-ctx2"),
    pytest.param(dict(rnn_type="rnn", chunk_frames=4, context_frames=1), id="birnn-relu-chunk4"),
    pytest.param(dict(bidirectional=False, context_frames=3), id="unigru-rowconv3"),
    pytest.param(dict(bidirectional=False, rnn_type="lstm"), id="unilstm-no-lookahead"),
    pytest.param(
        dict(
            conv_channels=(3, 3, 3),
            conv_kernel_freq=(3, 3, 3),
            conv_kernel_time=(3, 5, 3),
            conv_stride_freq=(1, 2, 1),
            conv_stride_time=(2, 1, 2),
            chunk_frames=3,
            context_frames=2,
        ),
        id="three-convs-stride4",
    ),
]


@pytest.mark.parametrize("changes", STREAMING)
@pytest.mark.parametrize("frames", [1, 9, 37, 64], ids=lambda t: f"T{t}")
def test_streaming_equals_offline(changes: dict, frames: int) -> None:
    model = _model(**changes)
    torch.manual_seed(frames)
    feats = torch.randn(frames, model.cfg.features.num_features) * 2
    with torch.no_grad():
        whole, out_len = model(feats.unsqueeze(0), torch.tensor([frames]))
        chunked = stream_utterance(model, feats, chunk=model.cfg.chunk_frames or 4)
    assert int(out_len[0]) == model.cfg.output_frames(frames) == chunked.shape[0]
    assert (whole[0] - chunked).abs().max().item() <= 1e-5


@pytest.mark.parametrize("changes", STREAMING[:1] + STREAMING[4:5])
def test_batch_equals_single(changes: dict) -> None:
    """Padding inside a batch changes nothing for the shorter utterances."""
    model = _model(**changes)
    lengths = [23, 40, 7]
    feats = [torch.randn(t, model.cfg.features.num_features) for t in lengths]
    batch = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    with torch.no_grad():
        out, out_len = model(batch, torch.tensor(lengths))
        for i, f in enumerate(feats):
            single, n = model(f.unsqueeze(0), torch.tensor([len(f)]))
            assert int(n[0]) == int(out_len[i])
            assert (out[i, : n[0]] - single[0]).abs().max().item() <= 1e-5


def test_training_step_lowers_ctc_loss() -> None:
    model = _model(chunk_frames=4, context_frames=2).train()
    feats = torch.randn(3, 50, model.cfg.features.num_features)
    lengths = torch.tensor([50, 44, 30])
    targets = torch.randint(1, len(model.cfg.vocabulary), (12,))
    target_len = torch.tensor([5, 4, 3])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        log_probs, out_len = model(feats, lengths)
        loss = ctc_loss(log_probs, out_len, targets, target_len)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param(dict(conv_channels=(4,)), "same length", id="conv-lists-mismatch"),
        pytest.param(dict(context_frames=2), "chunk_frames", id="bidi-context-without-chunk"),
        pytest.param(dict(rnn_layers=0), "positive", id="no-rnn-layers"),
        pytest.param(dict(vocabulary=("a", "b")), "blank", id="vocab-without-blank"),
    ],
)
def test_bad_model_config(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **changes)


def test_conv_norm_alone_is_batchnorm2d_bit_for_bit() -> None:
    """ConvBatchNorm without a process group is nn.BatchNorm2d: the same outputs,
    gradients and running statistics, bit for bit (a one-rank run trains as before)."""
    from torch import nn

    from echoic.model.nn.network import ConvBatchNorm

    torch.manual_seed(0)
    x = torch.randn(3, 4, 9, 17) * 2 + 1
    ours, theirs = ConvBatchNorm(4), nn.BatchNorm2d(4)
    theirs.load_state_dict(ours.state_dict())
    outs = []
    for norm in (ours, theirs):
        xi = x.clone().requires_grad_()
        (norm(xi) * torch.arange(17.0)).sum().backward()
        outs.append((norm(xi.detach()), xi.grad, *norm.state_dict().values()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
