"""The Deep Speech 2 acoustic model: conv front end, recurrent stack, CTC head.

Shape of the network (DS2, Amodei et al. 2016):

    raw log-spectrogram (B, T, F)
      -> fixed normalisation with the training set's mean and std (buffers)
      -> 2-3 Conv2d over (frequency, time), stride in time, clipped ReLU
      -> N recurrent layers (GRU, LSTM or clipped-ReLU RNN) with sequence-wise
         batch norm on their inputs; bidirectional layers sum both directions
      -> row convolution (lookahead) for unidirectional models
      -> linear + log-softmax over the vocabulary, one row per output frame

Streaming a BiRNN (latency-controlled mode, `chunk_frames > 0`): the forward
direction carries its state across chunks; the backward direction runs over each
chunk of C output frames plus R frames of right context, starting from zero at
the window's end. Each layer sees the right-context frames as computed inside
the same window (as in LC-BLSTM), so a window can be computed from nothing but
its own input and the forward states. Training runs exactly this computation, so
`forward()` on a whole utterance equals `step()` chunk after chunk.

Time padding is explicit and done once, in the input: the convolutions are
"valid" in time. Output frame n sees padded input frames [n*S, n*S + RF), where
S is the total time stride and RF the receptive field; the input is padded with
`pad_left` frames of the normalised value 0 (raw value: the feature mean) in
front and enough behind. A streaming client does the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from echoic.model.core.features import FeatureConfig
from echoic.model.core.text import DEFAULT_SYMBOLS
from echoic.model.nn import persistent


@dataclass(frozen=True)
class ModelConfig:
    name: str = "echoic-ds2"  # model name written to checkpoints and model cards
    features: FeatureConfig = field(default_factory=FeatureConfig)  # input features
    vocabulary: tuple[str, ...] = DEFAULT_SYMBOLS  # output symbols; index 0 is the CTC blank
    conv_channels: tuple[int, ...] = (32, 32)  # output channels of each Conv2d layer
    conv_kernel_freq: tuple[int, ...] = (41, 21)  # kernel height per layer, frequency bins
    conv_kernel_time: tuple[int, ...] = (11, 11)  # kernel width per layer, input frames
    conv_stride_freq: tuple[int, ...] = (2, 2)  # stride per layer, frequency bins
    conv_stride_time: tuple[int, ...] = (2, 1)  # stride per layer, frames
    rnn_type: Literal["gru", "lstm", "rnn"] = "gru"  # "rnn" = clipped-ReLU RNN as in DS2
    rnn_layers: int = 3  # number of recurrent layers
    rnn_hidden: int = 256  # hidden units per direction
    bidirectional: bool = True  # False: forward only, with a row convolution on top
    chunk_frames: int = 0  # C, output frames per chunk; 0 = full context (offline only)
    context_frames: int = 0  # R, output frames of right context (backward lookahead, or
    # the row convolution's lookahead for unidirectional models)
    relu_clip: float = 20.0  # ceiling of the clipped ReLU, activation units
    dropout: float = 0.0  # dropout between recurrent layers, probability

    def __post_init__(self) -> None:
        n = len(self.conv_channels)
        lists = (self.conv_kernel_freq, self.conv_kernel_time)
        lists += (self.conv_stride_freq, self.conv_stride_time)
        if not 1 <= n <= 3 or any(len(x) != n for x in lists):
            raise ValueError("conv_* lists must all have the same length, 1 to 3 layers")
        if self.rnn_layers < 1 or self.rnn_hidden < 1:
            raise ValueError("rnn_layers and rnn_hidden must be positive")
        if self.chunk_frames < 0 or self.context_frames < 0:
            raise ValueError("chunk_frames and context_frames must be >= 0")
        if self.bidirectional and self.context_frames and not self.chunk_frames:
            raise ValueError("context_frames needs chunk_frames > 0 for a bidirectional model")
        if self.vocabulary[0] != "<blank>":
            raise ValueError("the vocabulary must start with the CTC blank '<blank>'")

    @property
    def time_stride(self) -> int:
        """Input frames per output frame."""
        return math.prod(self.conv_stride_time)

    @property
    def receptive_field(self) -> int:
        """Input frames that one output frame of the conv stack sees."""
        rf, jump = 1, 1
        for k, s in zip(self.conv_kernel_time, self.conv_stride_time, strict=True):
            rf += (k - 1) * jump
            jump *= s
        return rf

    @property
    def pad_left(self) -> int:
        """Padding frames in front of the input: the conv stack is centred."""
        return (self.receptive_field - 1) // 2

    @property
    def streamable(self) -> bool:
        return not self.bidirectional or self.chunk_frames > 0

    def output_frames(self, input_frames: int) -> int:
        return -(-input_frames // self.time_stride)

    def window_input_frames(self, chunk: int) -> int:
        """Padded input frames that one streaming step over `chunk` outputs needs."""
        return (chunk + self.context_frames - 1) * self.time_stride + self.receptive_field


def batch_moments(
    x: Tensor, dims: tuple[int, ...], group: object = None
) -> tuple[Tensor, Tensor, int | Tensor]:
    """The mean and (biased) variance of `x` over `dims`, and how many values each is of.

    With a process group (`DeepSpeech2.share_norm_statistics`), over every rank's `x`
    together, as if one rank held them all: the sums cross the ranks with autograd, so
    each rank's gradient also carries what its values did to the others' statistics
    (what one rank computing the whole batch would get). Two passes, as a local
    variance is: the mean first, then the squared distances from it. The count is then a
    tensor filled on `x`'s device and never read back, so that the host does not wait for
    the GPU here (a caller's boolean mask, `SequenceBatchNorm`'s, still makes it wait).
    """
    count = math.prod(x.shape[d] for d in dims)
    if group is None:
        return x.mean(dims), x.var(dims, unbiased=False), count
    import torch.distributed as dist

    n = torch.full((), count, dtype=torch.float64, device=x.device)  # a fill, not a copy
    dist.all_reduce(n, group=group)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # sums over ranks in float32 under autocast too
    kept = [1 if d in dims else size for d, size in enumerate(x.shape)]  # broadcasts a moment
    mean = _SumOverRanks.apply(x.sum(dims), group) / n  # x's dtype: a 0-d n does not promote
    var = _SumOverRanks.apply((x - mean.reshape(kept)).square().sum(dims), group) / n
    return mean, var, n


def _update_running(
    norm: nn.Module, mean: Tensor, var: Tensor, n: int | Tensor, step: float
) -> None:
    """Move `norm`'s running statistics `step` of the way to a batch's, the variance made
    unbiased over its `n` values as torch's batch norms make it (with no host sync when `n`
    is a tensor)."""
    with torch.no_grad():
        less = (n - 1).clamp(min=1) if isinstance(n, Tensor) else max(n - 1, 1)
        norm.running_mean.lerp_(mean.detach().to(norm.running_mean.dtype), step)
        norm.running_var.lerp_(var.detach().to(norm.running_var.dtype) * n / less, step)


class _SumOverRanks(torch.autograd.Function):
    """The sum of a tensor over the ranks of a group; its gradient is the sum of the
    ranks' gradients of that sum (every rank's loss depends on it)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: object) -> Tensor:  # noqa: ANN001 (autograd's ctx)
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SequenceBatchNorm(nn.Module):
    """Batch norm over all valid (batch, time) positions: padding does not count."""

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.group: object = None  # statistics over every rank's batch (batch_moments)

    def forward(self, x: Tensor, mask: Tensor, *more: Tensor) -> list[Tensor]:
        if self.training:
            mean, var, n = batch_moments(x[mask], (0,), self.group)  # the (N, D) valid rows
            _update_running(self, mean, var, n, self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        return [t * scale + shift for t in (x, *more)]


class ConvBatchNorm(nn.BatchNorm2d):
    """nn.BatchNorm2d (every position of (B, C, F, T), per channel) that, given a process
    group, takes its training statistics over every rank's batch (`batch_moments`);
    without one it is nn.BatchNorm2d itself. Same parameters and buffers."""

    group: object = None

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and self.group is not None):
            return super().forward(x)
        mean, var, n = batch_moments(x, (0, 2, 3), self.group)  # per channel of (B, C, F, T)
        with torch.no_grad():
            self.num_batches_tracked += 1
        step = self.momentum if self.momentum is not None else 1 / int(self.num_batches_tracked)
        _update_running(self, mean, var, n, step)
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        return (x * scale[:, None, None] + shift[:, None, None]).to(x.dtype)


class ClippedReLURNN(nn.Module):
    """h_t = min(max(W x_t + b + U h_{t-1} + c, 0), clip), with nn.RNN's parameter names."""

    def __init__(self, input_size: int, hidden_size: int, clip: float) -> None:
        super().__init__()
        self.hidden_size, self.clip = hidden_size, clip
        k = 1.0 / math.sqrt(hidden_size)
        self.weight_ih_l0 = nn.Parameter(torch.empty(hidden_size, input_size).uniform_(-k, k))
        self.weight_hh_l0 = nn.Parameter(torch.empty(hidden_size, hidden_size).uniform_(-k, k))
        self.bias_ih_l0 = nn.Parameter(torch.empty(hidden_size).uniform_(-k, k))
        self.bias_hh_l0 = nn.Parameter(torch.empty(hidden_size).uniform_(-k, k))

    def forward(self, x: Tensor, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        xw = F.linear(x, self.weight_ih_l0, self.bias_ih_l0 + self.bias_hh_l0)  # (B, T, H)
        h = x.new_zeros(x.shape[0], self.hidden_size) if h0 is None else h0[0]
        out, h = _clipped_relu_steps(xw, h, self.weight_hh_l0, self.clip)  # (B, T, H), (B, H)
        return out, h.unsqueeze(0)


# Loops over time or chunks are scripted when traced (ONNX export), so the exported
# graph loops as many times as its input needs instead of as many as the example had.


@torch.jit.script_if_tracing
def _clipped_relu_steps(xw: Tensor, h: Tensor, w_hh: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """ClippedReLURNN's recurrence over input projections xw (B, T, H) from h (B, H)."""
    outs: list[Tensor] = []
    for i in range(xw.shape[1]):
        h = torch.clamp(xw[:, i] + F.linear(h, w_hh), 0.0, clip)
        outs.append(h)
    out = torch.stack(outs, 1) if len(outs) > 0 else xw  # xw is (B, 0, H) when T = 0
    return out, h


@torch.jit.script_if_tracing
def _lstm_over_chunks(
    x: Tensor, h: Tensor, c: Tensor, weights: list[Tensor], chunk: int, training: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """A one-layer nn.LSTM, given its weights, over the K chunks of x (B, K*C, D).

    nn.LSTM returns its cell state only after the last step, so this runs chunk by
    chunk to collect it after each one. Returns outputs (B, K*C, H) and h, c after
    each chunk, each (B, K, H).
    """
    outs: list[Tensor] = []
    hs: list[Tensor] = []
    cs: list[Tensor] = []
    for k in range(x.shape[1] // chunk):
        piece = x[:, k * chunk : (k + 1) * chunk]
        out, h, c = torch.lstm(piece, [h, c], weights, True, 1, 0.0, training, False, True)
        outs.append(out)
        hs.append(h)
        cs.append(c)
    return torch.cat(outs, 1), torch.cat(hs).transpose(0, 1), torch.cat(cs).transpose(0, 1)


def _make_rnn(cfg: ModelConfig, input_size: int) -> nn.Module:
    h = cfg.rnn_hidden
    if cfg.rnn_type == "gru":
        return nn.GRU(input_size, h, batch_first=True)
    if cfg.rnn_type == "lstm":
        return nn.LSTM(input_size, h, batch_first=True)
    return ClippedReLURNN(input_size, h, cfg.relu_clip)


def _reverse_within(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each row of (N, T, D) within its first lengths[n] steps; the rest stays put."""
    t = x.shape[1]
    steps = torch.arange(t, device=x.device).unsqueeze(0)  # (1, T)
    lengths = lengths.unsqueeze(1)
    idx = torch.where(steps < lengths, lengths - 1 - steps, steps)  # (N, T)
    return torch.gather(x, 1, idx.unsqueeze(-1).expand_as(x))


def _ceil_div(n: int | Tensor, d: int) -> int | Tensor:
    """ceil(n / d) for n >= 0, an int or a tensor. Not -(-n // d): in an exported graph
    integer division truncates, so that form would round negative quotients the wrong way."""
    return (n + d - 1) // d


State = tuple[Tensor, ...]  # per direction-carrying layer: (h,) or (h, c), each (1, B, H)


class RecurrentLayer(nn.Module):
    """One recurrent layer in latency-controlled form.

    Inputs are the main frames x (B, K*C, D), their valid mask, the right-context
    frames of each window ctx (B, K, R, D) and the forward state entering chunk 0.
    Returns the same three things for the next layer plus the forward state after
    the last chunk (what a streaming step carries to the next one).
    """

    def __init__(self, cfg: ModelConfig, input_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = SequenceBatchNorm(input_size)
        self.fwd = _make_rnn(cfg, input_size)
        self.bwd = _make_rnn(cfg, input_size) if cfg.bidirectional else None
        # Recurrent kernels on the GPU, "cudnn", "persistent" or "auto" (training's
        # rnn_impl). Not part of the model: the same parameters, results equal to float tolerance.
        self.rnn_impl = "cudnn"

    def _forward_dir(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """Run the forward direction over all chunks of x (B, K*C, D).

        Returns its outputs (B, K*C, H) and its state after each chunk, each part
        (B, K, H). A model that is not chunked has one window (K = 1).
        """
        chunk = self.cfg.chunk_frames if self.cfg.bidirectional else 0
        lstm = self.cfg.rnn_type == "lstm"
        if not chunk:  # one window: the state after it is the one the RNN returns
            out, last = self.fwd(x, state if lstm else state[0].contiguous())
            return out, tuple(s.transpose(0, 1) for s in (last if lstm else (last,)))
        if not lstm:  # the state of a GRU or plain RNN is its output
            out, _ = self.fwd(x, state[0].contiguous())  # (B, K*C, H)
            return out, (out[:, chunk - 1 :: chunk],)
        weights = self.fwd.all_weights[0]  # [w_ih, w_hh, b_ih, b_hh], as nn.LSTM passes them
        out, h, c = _lstm_over_chunks(x, state[0], state[1], weights, chunk, self.training)
        return out, (h, c)

    def forward(
        self, x: Tensor, mask: Tensor, ctx: Tensor, ctx_mask: Tensor, state: State, chunk: int
    ) -> tuple[Tensor, Tensor, State]:
        b, kc, _ = x.shape
        k, r = ctx.shape[1], self.cfg.context_frames
        x, ctx = self.norm(x, mask, ctx)
        win = win_len = None
        if self.bwd is not None:  # each window (chunk + its right context), backward
            win = torch.cat([x.reshape(b, k, chunk, -1), ctx], 2).reshape(b * k, chunk + r, -1)
            win_len = (mask.reshape(b, k, chunk).sum(2) + ctx_mask.sum(2)).reshape(b * k)
        # Persistent kernels run both directions in one launch; None: the modules do.
        fused = persistent.run_layer(self, x, state, win, win_len)
        if fused is None:
            out_f, ends = self._forward_dir(x, state)  # (B, K*C, H), each (B, K, H)
        else:  # a GRU's or plain RNN's state is its output
            out_f, ends = fused[0], (fused[0][:, chunk - 1 :: chunk],)
        final = tuple(e[:, -1].unsqueeze(0) for e in ends)  # each (1, B, H)
        ctx_out = ctx.new_zeros(b, k, r, self.cfg.rnn_hidden)
        if r:
            # Right context of window k continues the forward state at the end of chunk k.
            # cuDNN takes only a contiguous state, and `ends` are strided views of the
            # outputs (every chunk-th step): a copy (the CPU modules accept either).
            h0 = tuple(e.reshape(1, b * k, -1).contiguous() for e in ends)  # each (1, B*K, H)
            ctx_f, _ = self.fwd(ctx.reshape(b * k, r, -1), h0 if len(h0) > 1 else h0[0])
            ctx_out = ctx_f.reshape(b, k, r, -1)
        if self.bwd is None:
            return out_f, ctx_out, final
        # Backward: each window from a zero state at its end.
        if fused is None:
            back = _reverse_within(self.bwd(_reverse_within(win, win_len))[0], win_len)
        else:
            back = fused[1]
        back = back.reshape(b, k, chunk + r, -1)
        out = out_f + back[:, :, :chunk].reshape(b, kc, -1)
        return out, ctx_out + back[:, :, chunk:], final


class DeepSpeech2(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        nf = cfg.features.num_features
        self.register_buffer("feature_mean", torch.zeros(nf))
        self.register_buffer("feature_std", torch.ones(nf))
        convs: list[nn.Module] = []
        cin, freq = 1, nf
        for cout, kf, kt, sf, st in zip(
            cfg.conv_channels,
            cfg.conv_kernel_freq,
            cfg.conv_kernel_time,
            cfg.conv_stride_freq,
            cfg.conv_stride_time,
            strict=True,
        ):
            convs += [
                nn.Conv2d(cin, cout, (kf, kt), (sf, st), padding=(kf // 2, 0), bias=False),
                ConvBatchNorm(cout),
                nn.Hardtanh(0.0, cfg.relu_clip),
            ]
            cin, freq = cout, (freq + 2 * (kf // 2) - kf) // sf + 1
        self.conv = nn.Sequential(*convs)
        size = cin * freq
        self.rnns = nn.ModuleList()
        for _ in range(cfg.rnn_layers):
            self.rnns.append(RecurrentLayer(cfg, size))
            size = cfg.rnn_hidden
        self.dropout = nn.Dropout(cfg.dropout)
        lookahead = 0 if cfg.bidirectional else cfg.context_frames
        self.row_conv = (
            nn.Parameter(torch.ones(lookahead + 1, size) / (lookahead + 1)) if lookahead else None
        )
        self.head_norm = SequenceBatchNorm(size)
        self.head = nn.Linear(size, len(cfg.vocabulary))

    # ---- helpers shared by forward() and step() ----------------------------------

    def _normalise(self, feats: Tensor, valid: Tensor) -> Tensor:
        x = (feats - self.feature_mean) / self.feature_std  # (B, T, F)
        return x * valid.unsqueeze(-1)

    def _conv(self, x: Tensor) -> Tensor:
        x = self.conv(x.transpose(1, 2).unsqueeze(1))  # (B, C, F', T')
        b, c, f, t = x.shape
        return x.reshape(b, c * f, t).transpose(1, 2)  # (B, T', C*F')

    def share_norm_statistics(self, group: object) -> None:
        """Take every batch norm's training statistics over all ranks of `group` (a
        torch.distributed process group; None: this rank's batch alone), so that ranks
        that split one batch compute what one rank given all of it would."""
        for module in self.modules():
            if isinstance(module, SequenceBatchNorm | ConvBatchNorm):
                module.group = group

    def set_rnn_impl(self, impl: Literal["auto", "cudnn", "persistent"]) -> None:
        """Which kernels run the GRU and plain RNN layers on a GPU (see model/nn/persistent)."""
        for layer in self.rnns:
            layer.rnn_impl = impl

    def initial_state(self, batch: int) -> list[State]:
        n = 2 if self.cfg.rnn_type == "lstm" else 1
        z = self.feature_mean.new_zeros(1, batch, self.cfg.rnn_hidden)
        return [tuple(z for _ in range(n)) for _ in self.rnns]

    def _windows(
        self, x: Tensor, out_len: Tensor, chunk: int, k: int, state: list[State]
    ) -> tuple[Tensor, list[State]]:
        """Run the recurrent stack and head over K windows of a conv output (B, >= K*C+R, D)."""
        b = x.shape[0]
        r = self.cfg.context_frames
        steps = torch.arange(k * chunk + r, device=x.device)
        valid = steps.unsqueeze(0) < out_len.unsqueeze(1)  # (B, K*C+R)
        main, mask = x[:, : k * chunk], valid[:, : k * chunk]
        main = main * mask.unsqueeze(-1)
        idx = (torch.arange(k, device=x.device) * chunk + chunk).unsqueeze(1) + torch.arange(
            r, device=x.device
        )  # (K, R): frames of each window's right context
        ctx, ctx_mask = x[:, idx], valid[:, idx]  # (B, K, R, D), (B, K, R)
        ctx = ctx * ctx_mask.unsqueeze(-1)
        new_state = []
        for i, layer in enumerate(self.rnns):
            if i:
                main, ctx = self.dropout(main), self.dropout(ctx)
            main, ctx, s = layer(main, mask, ctx, ctx_mask, state[i], chunk)
            main, ctx = main * mask.unsqueeze(-1), ctx * ctx_mask.unsqueeze(-1)
            new_state.append(s)
        if self.row_conv is not None:
            # Lookahead over the next R frames of the same window; beyond the end: zeros.
            w = torch.cat([main.reshape(b, k, chunk, -1), ctx], 2)  # (B, K, C+R, H)
            main = sum(self.row_conv[j] * w[:, :, j : j + chunk] for j in range(r + 1)).reshape(
                b, k * chunk, -1
            )
            main = torch.clamp(main, 0.0, self.cfg.relu_clip)
        (main,) = self.head_norm(main, mask)
        return F.log_softmax(self.head(main), dim=-1), new_state  # (B, K*C, V)

    # ---- the two entry points ----------------------------------------------------

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Whole utterances: raw features (B, T, F), lengths (B,) -> log-probs (B, T', V), T'."""
        cfg = self.cfg
        b, t, _ = features.shape
        out_len = _ceil_div(lengths, cfg.time_stride)
        t_out = _ceil_div(t, cfg.time_stride)
        valid = torch.arange(t, device=features.device).unsqueeze(0) < lengths.unsqueeze(1)
        x = self._normalise(features, valid)
        # At least one output frame, so the recurrent layers never see an empty sequence;
        # this is max(t_out, 1) in a form that an ONNX trace keeps symbolic.
        frames = t_out + (t_out < 1)
        if cfg.bidirectional and cfg.chunk_frames:
            chunk, k = cfg.chunk_frames, _ceil_div(frames, cfg.chunk_frames)
        else:  # unidirectional layers are causal, so chunking cannot change them: one window
            chunk, k = frames, 1
        need = (k * chunk + cfg.context_frames - 1) * cfg.time_stride + cfg.receptive_field
        x = F.pad(x, (0, 0, cfg.pad_left, need - t - cfg.pad_left))  # (B, need, F)
        log_probs, _ = self._windows(self._conv(x), out_len, chunk, k, self.initial_state(b))
        return log_probs[:, :t_out], out_len

    def step(
        self, window: Tensor, out_frames: Tensor, state: list[State]
    ) -> tuple[Tensor, list[State]]:
        """One streaming step over B streams.

        window: raw features (B, window_input_frames(C), F), already padded with the
        feature mean where there is no audio (before the start, after the end).
        out_frames: (B,) valid output frames in this window (C + R except at the end).
        Returns log-probs for the C chunk frames (B, C, V) and the forward states after them.
        """
        valid = torch.ones(window.shape[:2], dtype=torch.bool, device=window.device)
        x = self._conv(self._normalise(window, valid))  # (B, C+R, D)
        chunk = x.shape[1] - self.cfg.context_frames
        return self._windows(x, out_frames, chunk, 1, state)


def ctc_loss(log_probs: Tensor, out_len: Tensor, targets: Tensor, target_len: Tensor) -> Tensor:
    """CTC loss summed over each utterance, averaged over the batch."""
    loss = F.ctc_loss(
        log_probs.transpose(0, 1).float(),
        targets,
        out_len,
        target_len,
        blank=0,
        reduction="sum",
        zero_infinity=True,
    )
    return loss / log_probs.shape[0]


def stream_utterance(model: DeepSpeech2, features: Tensor, chunk: int | None = None) -> Tensor:
    """Transcribe one utterance (T, F) step by step, as a streaming client would.

    Used to check that streaming equals offline; the serving engine does the same
    with ONNX Runtime.
    """
    cfg = model.cfg
    chunk = chunk or cfg.chunk_frames or 16
    if cfg.bidirectional and chunk != cfg.chunk_frames:
        raise ValueError("a bidirectional model streams only with its trained chunk size")
    t = features.shape[0]
    t_out = cfg.output_frames(t)
    n_win = cfg.window_input_frames(chunk)
    pad = features.new_empty(0, features.shape[1])
    mean = model.feature_mean.expand(1, -1)
    padded = torch.cat([mean.expand(cfg.pad_left, -1), features, pad])
    state = model.initial_state(1)
    outs = []
    for start in range(0, t_out, chunk):
        lo = start * cfg.time_stride
        win = padded[lo : lo + n_win]
        if win.shape[0] < n_win:
            win = torch.cat([win, mean.expand(n_win - win.shape[0], -1)])
        valid = min(t_out - start, chunk + cfg.context_frames)
        lp, state = model.step(win.unsqueeze(0), torch.tensor([valid]), state)
        outs.append(lp[0, : min(chunk, t_out - start)])
    return torch.cat(outs) if outs else features.new_zeros(0, len(cfg.vocabulary))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops(cfg: ModelConfig, frames: int, *, window: bool = False) -> float:
    """Multiply-adds x 2 of one forward pass over `frames` feature frames (one utterance).

    An analytic count (convolutions, recurrent layers with their input projections,
    output layer) for benchmarks that state speed as a fraction of the hardware's.
    A chunked bidirectional model re-runs each chunk's right context; that is counted,
    except with `window`: `frames` is then one streaming window
    (`ModelCard.window_input_frames`), whose context frames are already in it.
    """
    flops, freq, t = 0.0, cfg.features.num_features, frames
    cin = 1
    for cout, kf, kt, sf, st in zip(
        cfg.conv_channels, cfg.conv_kernel_freq, cfg.conv_kernel_time,
        cfg.conv_stride_freq, cfg.conv_stride_time, strict=True,
    ):  # fmt: skip
        freq, t = (freq + 2 * (kf // 2) - kf) // sf + 1, max(t - kt, 0) // st + 1  # time: valid
        flops += 2 * cin * cout * kf * kt * freq * t
        cin = cout
    d, h = cin * freq, cfg.rnn_hidden
    gates = {"gru": 3, "lstm": 4, "rnn": 1}[cfg.rnn_type]
    c, r = cfg.chunk_frames, cfg.context_frames
    extra = (1 + r / c) if (c and cfg.bidirectional and not window) else 1.0
    dirs = 2 if cfg.bidirectional else 1
    for _ in range(cfg.rnn_layers):
        flops += dirs * extra * t * 2 * gates * h * (d + h)
        d = h  # the directions are summed
    return flops + 2 * t * h * len(cfg.vocabulary)
