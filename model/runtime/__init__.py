"""echoic.model.runtime: an exported model run by ONNX Runtime.

The model card, the `Engine` (model.onnx and stream.onnx sessions) and the
`Recognizer` (features -> engine -> decoder, offline and streaming). What the
server and `echoic transcribe` run; never imports torch.
"""
