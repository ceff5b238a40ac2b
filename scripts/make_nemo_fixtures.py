"""Make tests/fixtures/nemo/: tiny randomly initialised NeMo CTC models, made, saved and
exported by NeMo itself, with NeMo's own features and log-probs on a real clip.

Run once, in a virtual environment that has NeMo (it is not one of echoic's extras:
see docs/models-and-import.md, "Serving other models"):

    python3 -m venv /tmp/nemo-venv
    /tmp/nemo-venv/bin/pip install torch 'nemo_toolkit[asr]==3.0.0' onnx onnxruntime soundfile
    /tmp/nemo-venv/bin/python scripts/make_nemo_fixtures.py

It writes, for each model (`chars`: an EncDecCTCModel with a QuartzNet-style ConvASR
encoder over characters; `bpe`: an EncDecCTCModelBPE with a Conformer encoder over a
SentencePiece tokenizer trained here on a few sentences):

    NAME.nemo    NeMo's `save_to`: model_config.yaml, model_weights.ckpt (and the tokenizer)
    NAME.onnx    NeMo's `export()`: audio_signal (B, F, T), length (B,) -> logprobs (B, T', V)
    NAME.npz     NeMo's own preprocessor and model on the clip and on a batch of the clip
                 and its first 1.3 s (`sample_lengths`, samples: the clip's first),
                 `features` (B, F, T) and `feature_lengths` (the preprocessor's),
                 `log_probs` (B, T', V) and `out_lengths` (the model's forward), `greedy`
                 (the model's own greedy transcript of the whole clip)

and `clip.flac`: "the quick brown fox jumps over the lazy dog" by espeak-ng, 16 kHz.
Random weights spell nothing real; the output layer is scaled (and the word separator
favoured) so that a greedy decode spells several words to compare.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nemo"
RATE = 16000
TEXT = "the quick brown fox jumps over the lazy dog"
LABELS = [" ", *"abcdefghijklmnopqrstuvwxyz", "'"]
SHORT_SECONDS = 1.3  # the second row of the batch: the clip's start


def preprocessor(features: int) -> dict:
    """A real model's preprocessor settings (Conformer-CTC's and QuartzNet's)."""
    return {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
        "sample_rate": RATE,
        "normalize": "per_feature",
        "window_size": 0.025,
        "window_stride": 0.01,
        "window": "hann",
        "features": features,
        "n_fft": 512,
        "log": True,
        "frame_splicing": 1,
        "dither": 1e-5,
        "pad_to": 16,
        "pad_value": 0.0,
    }


def quartznet_config() -> dict:
    """Two Jasper blocks, the first with stride 2 (as QuartzNet's), 16 channels."""
    block = {
        "dilation": [1],
        "dropout": 0.0,
        "residual": False,
        "separable": True,
        "se": False,
    }
    return {
        "sample_rate": RATE,
        "labels": LABELS,
        "preprocessor": preprocessor(64),
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConvASREncoder",
            "feat_in": 64,
            "activation": "relu",
            "conv_mask": True,
            "jasper": [
                {**block, "filters": 16, "repeat": 1, "kernel": [11], "stride": [2]},
                {**block, "filters": 16, "repeat": 1, "kernel": [5], "stride": [1]},
            ],
        },
        "decoder": {
            "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
            "feat_in": 16,
            "num_classes": len(LABELS),
            "vocabulary": LABELS,
        },
    }


def conformer_config(tokenizer_dir: Path) -> dict:
    """One Conformer layer, d_model 16, 4x striding subsampling (as Conformer-CTC's)."""
    return {
        "sample_rate": RATE,
        "tokenizer": {"dir": str(tokenizer_dir), "type": "bpe"},
        "preprocessor": preprocessor(80),
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": 80,
            "feat_out": -1,
            "n_layers": 1,
            "d_model": 16,
            "subsampling": "striding",
            "subsampling_factor": 4,
            "subsampling_conv_channels": 8,
            "ff_expansion_factor": 2,
            "self_attention_model": "rel_pos",
            "n_heads": 2,
            "conv_kernel_size": 9,
            "dropout": 0.0,
            "dropout_pre_encoder": 0.0,
            "dropout_emb": 0.0,
            "dropout_att": 0.0,
            "pos_emb_max_len": 128,  # 5 s of frames; the default 5000 would be most of the file
        },
        "decoder": {
            "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
            "feat_in": 16,
            "num_classes": -1,  # the tokenizer's size
            "vocabulary": [],
        },
    }


def train_tokenizer(out: Path) -> Path:
    """A SentencePiece BPE tokenizer of 40 pieces, as NeMo's process_asr_text_tokenizer
    makes one (tokenizer.model, tokenizer.vocab, vocab.txt)."""
    import sentencepiece as spm

    text = out / "text.txt"
    lines = [TEXT, "a quick test of the tiny tokenizer", "the dog sat on the brown mat"]
    text.write_text("\n".join(lines * 20) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(out / "tokenizer"),
        vocab_size=40,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=-1,
        eos_id=-1,
        normalization_rule_name="identity",  # no normalisation table (most of the file)
        minloglevel=2,
    )
    pieces = [line.split("\t")[0] for line in (out / "tokenizer.vocab").read_text().splitlines()]
    # vocab.txt as NeMo writes it: one token a line, "##" before a token inside a word.
    words = [p[1:] if p.startswith("\u2581") else "##" + p for p in pieces]
    (out / "vocab.txt").write_text("\n".join(words) + "\n")
    text.unlink()
    return out


def speak(out: Path) -> np.ndarray:
    wav = out / "clip.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(wav), TEXT], check=True)
    samples, rate = sf.read(wav, dtype="float32")
    wav.unlink()
    if rate != RATE:
        import soxr

        samples = soxr.resample(samples, rate, RATE).astype(np.float32)
    samples = samples[: int(2.6 * RATE)]  # the sentence, without the trailing silence
    sf.write(out / "clip.flac", samples, RATE, subtype="PCM_16")
    samples, _ = sf.read(out / "clip.flac", dtype="float32")  # as the tests read it
    return samples


def sharpen(model, word_start: list[int], unk: int | None = None, scale: float = 6.0) -> None:
    """Make random weights spell: larger output weights, word starts favoured. A trained
    model gives <unk> next to no probability; random weights do not, so its bias is set
    far down to match (the importer folds it into the blank)."""
    layer = model.decoder.decoder_layers[0]
    with torch.no_grad():
        layer.weight.mul_(scale)
        for i in word_start:
            layer.bias[i] += 1.0
        if unk is not None:
            layer.bias[unk] = -30.0


def record(model, name: str, clip: np.ndarray) -> None:
    model.eval()
    short = clip[: int(SHORT_SECONDS * RATE)]
    samples = np.zeros((2, len(clip)), dtype=np.float32)
    samples[0], samples[1, : len(short)] = clip, short
    lengths = np.array([len(clip), len(short)], dtype=np.int64)
    with torch.no_grad():
        signal, signal_lengths = torch.from_numpy(samples), torch.from_numpy(lengths)
        features, feature_lengths = model.preprocessor(input_signal=signal, length=signal_lengths)
        log_probs, out_lengths, _ = model.forward(
            input_signal=signal, input_signal_length=signal_lengths
        )
    greedy = model.transcribe([clip], batch_size=1, verbose=False)[0].text
    np.savez_compressed(
        OUT / f"{name}.npz",
        sample_lengths=lengths,
        features=features.numpy(),
        feature_lengths=feature_lengths.numpy(),
        log_probs=log_probs.numpy(),
        out_lengths=out_lengths.numpy(),
        greedy=np.array(greedy),
    )
    model.save_to(str(OUT / f"{name}.nemo"))
    model.export(str(OUT / f"{name}.onnx"), check_trace=False, verbose=False)
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters; greedy {greedy!r}")


def main() -> int:
    from nemo.collections.asr.models import EncDecCTCModel, EncDecCTCModelBPE
    from omegaconf import OmegaConf

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    clip = speak(OUT)

    torch.manual_seed(0)
    chars = EncDecCTCModel(cfg=OmegaConf.create(quartznet_config()))
    sharpen(chars, [LABELS.index(" ")], scale=30.0)
    record(chars, "chars", clip)

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = train_tokenizer(Path(tmp))
        torch.manual_seed(0)
        bpe = EncDecCTCModelBPE(cfg=OmegaConf.create(conformer_config(tokenizer_dir)))
        vocab = bpe.tokenizer.vocab
        starts = [i for i, t in enumerate(vocab) if t.startswith("\u2581")]
        sharpen(bpe, starts, unk=vocab.index("<unk>"))
        record(bpe, "bpe", clip)

    import nemo

    (OUT / "VERSIONS.json").write_text(
        json.dumps({"nemo_toolkit": nemo.__version__, "torch": torch.__version__}, indent=2) + "\n"
    )
    for path in sorted(OUT.iterdir()):
        print(f"{path.name}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
