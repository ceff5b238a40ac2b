"""echoic.model: what training and serving share, split by dependency.

- `echoic.model.core`: numpy only (audio, text, features, decoding, lm, configs);
- `echoic.model.runtime`: ONNX Runtime (card, engine, recognizer);
- `echoic.model.nn`: torch (network, persistent kernels, checkpoint reading, export).

docs/ARCHITECTURE.md gives the import rules; tests/test_boundaries.py enforces them.
"""
