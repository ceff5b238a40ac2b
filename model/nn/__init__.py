"""echoic.model.nn: the torch side.

The Deep Speech 2 network, its persistent RNN kernels (`persistent/`), reading a
checkpoint back into a network, and ONNX export. Only training, export and
benchmarks import it.
"""
