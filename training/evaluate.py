"""Greedy-decoding evaluation during training: CTC loss, CER and WER (jiwer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jiwer
import numpy as np
import torch

from echoic.model.audio import load_audio
from echoic.model.decoding import greedy_decode_batch
from echoic.model.features import compute_features
from echoic.model.network import DeepSpeech2, ctc_loss
from echoic.model.text import Vocabulary

if TYPE_CHECKING:
    from echoic.training.train import TrainConfig


def error_rates(references: list[str], hypotheses: list[str]) -> dict[str, float]:
    """Corpus-level WER and CER; an empty hypothesis counts as all deletions."""
    refs = [r if r.strip() else "<empty>" for r in references]
    return {"wer": float(jiwer.wer(refs, hypotheses)), "cer": float(jiwer.cer(refs, hypotheses))}


@torch.no_grad()
def evaluate(
    model: DeepSpeech2,
    utts: list,
    cfg: TrainConfig,
    device: torch.device,
    limit: int = 0,
    batch_size: int = 16,
) -> dict[str, float]:
    """Evaluate on `utts` (every k-th one when `limit` is set, so the subset is stable)."""
    if limit and len(utts) > limit:
        utts = utts[:: len(utts) // limit][:limit]
    utts = sorted(utts, key=lambda u: u.duration)
    vocab = Vocabulary(cfg.model.vocabulary)
    fcfg = cfg.model.features
    model.eval()
    refs, hyps, loss_sum = [], [], 0.0
    for i in range(0, len(utts), batch_size):
        batch = utts[i : i + batch_size]
        feats = [compute_features(load_audio(u.path, fcfg.sample_rate), fcfg) for u in batch]
        lengths = torch.tensor([len(f) for f in feats])
        padded = np.zeros((len(feats), int(lengths.max()), fcfg.num_features), np.float32)
        for j, f in enumerate(feats):
            padded[j, : len(f)] = f
        log_probs, out_len = model(torch.from_numpy(padded).to(device), lengths.to(device))
        log_probs, out_len = log_probs.float().cpu(), out_len.cpu()
        targets = torch.tensor([t for u in batch for t in u.tokens], dtype=torch.long)
        target_len = torch.tensor([len(u.tokens) for u in batch])
        loss_sum += float(ctc_loss(log_probs, out_len, targets, target_len)) * len(batch)
        hyps += greedy_decode_batch(log_probs.numpy(), out_len.numpy(), vocab)
        refs += [u.text for u in batch]
    return {"val_loss": loss_sum / max(len(utts), 1), **error_rates(refs, hyps)}
