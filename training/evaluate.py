"""Greedy-decoding evaluation during training: CTC loss, CER and WER (jiwer)."""

from __future__ import annotations

import jiwer
import torch

from echoic.model.core.decoding import greedy_decode_batch
from echoic.model.core.text import Vocabulary
from echoic.model.nn.network import DeepSpeech2, ModelConfig, ctc_loss
from echoic.training.data import SpeechDataset, collate


def error_rates(references: list[str], hypotheses: list[str]) -> dict[str, float]:
    """Corpus-level WER and CER; an empty hypothesis counts as all deletions."""
    refs = [r if r.strip() else "<empty>" for r in references]
    return {"wer": float(jiwer.wer(refs, hypotheses)), "cer": float(jiwer.cer(refs, hypotheses))}


@torch.no_grad()
def evaluate(
    model: DeepSpeech2,
    utts: list,
    cfg: ModelConfig,
    device: torch.device,
    limit: int = 0,
    batch_size: int = 16,
) -> dict[str, float]:
    """Evaluate on `utts` (every k-th one when `limit` is set, so the subset is stable)."""
    if limit and len(utts) > limit:
        utts = utts[:: len(utts) // limit][:limit]
    utts = sorted(utts, key=lambda u: u.duration)
    vocab = Vocabulary(cfg.vocabulary)
    dataset = SpeechDataset(utts, cfg.features)
    model.eval()
    refs, hyps, loss_sum = [], [], 0.0
    for i in range(0, len(utts), batch_size):
        examples = [dataset[j] for j in range(i, min(i + batch_size, len(utts)))]
        batch = collate(examples)
        log_probs, out_len = model(batch.features.to(device), batch.feature_lengths.to(device))
        log_probs, out_len = log_probs.float().cpu(), out_len.cpu()
        loss = ctc_loss(log_probs, out_len, batch.targets, batch.target_lengths)
        loss_sum += float(loss) * len(examples)
        hyps += greedy_decode_batch(log_probs.numpy(), out_len.numpy(), vocab)
        refs += [utts[e.index].text for e in examples]
    return {"val_loss": loss_sum / max(len(utts), 1), **error_rates(refs, hyps)}
