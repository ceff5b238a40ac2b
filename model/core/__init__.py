"""echoic.model.core: numpy only (plus soundfile and soxr for audio files).

Audio decoding, text and vocabulary, features, CTC decoding, the word LM and the
config machinery: what training and serving share. Imports neither torch nor
onnxruntime (docs/ARCHITECTURE.md, import rules).
"""
