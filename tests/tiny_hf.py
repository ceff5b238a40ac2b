"""Tiny randomly initialised Hugging Face CTC models, built with the real `transformers`
classes and written by their own `save_pretrained`: what `echoic import-model` reads,
with no download."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A character vocabulary laid out as the released English wav2vec2 CTC models have it:
# the pad token (CTC's blank) first, the special tokens, "|" between words, then
# upper-case letters by frequency.
VOCAB = {
    "<pad>": 0,
    "<s>": 1,
    "</s>": 2,
    "<unk>": 3,
    "|": 4,
    **{c: i + 5 for i, c in enumerate("ETAONISRHDLUMCWFGYPBVK'XJQZ")},
}
SPECIAL = ("<s>", "</s>", "<unk>")


def save_tiny_ctc(
    out: Path, architecture: str = "Wav2Vec2ForCTC", *, layer_norm: bool = True
) -> Path:
    """A two-layer, 32-wide model of `architecture` (Wav2Vec2ForCTC or HubertForCTC) with
    wav2vec2's convolutional front end (strides 5*2^6 = 320 samples), saved to `out`
    with its tokenizer and feature extractor. layer_norm: the large models' layer-norm
    front end, fed an attention mask; else base's group norm, fed none.

    Trained models give the special tokens next to no probability; random weights do
    not, so their output biases are set far down to match (the importer folds them into
    the blank, which then changes no best path)."""
    import transformers

    config_cls = getattr(transformers, architecture.replace("ForCTC", "Config"))
    config = config_cls(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16,) * 7,
        conv_stride=(5, 2, 2, 2, 2, 2, 2),
        conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer" if layer_norm else "group",
        do_stable_layer_norm=layer_norm,
        pad_token_id=VOCAB["<pad>"],
        bos_token_id=VOCAB["<s>"],
        eos_token_id=VOCAB["</s>"],
    )
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        # Larger output weights: a random model's frames then disagree on their best
        # token, so a greedy decode spells something to compare.
        model.lm_head.weight.mul_(8.0)
        for token in SPECIAL:
            model.lm_head.bias[VOCAB[token]] = -30.0
        model.lm_head.bias[VOCAB["|"]] = 1.0  # several words, not one long string of letters
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    vocab_file = out / "vocab.json"
    vocab_file.write_text(json.dumps(VOCAB))
    tokenizer = transformers.Wav2Vec2CTCTokenizer(str(vocab_file))
    extractor = transformers.Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=16000,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=layer_norm,
    )
    processor = transformers.Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer)
    processor.save_pretrained(out)
    return out


if __name__ == "__main__":  # python -m tests.tiny_hf OUT (bench/long_audio_memory.py)
    import sys

    save_tiny_ctc(Path(sys.argv[1]))
