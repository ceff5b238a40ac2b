"""echoic.model: the parts shared by training and serving.

The torch-free modules (audio, text, features, decoding) import only numpy and
soundfile; `network` and `export` are the only ones that import torch.
"""
