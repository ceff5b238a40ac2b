"""echoic.protos: the gRPC API. Sources in protos/echoic/v1/*.proto (package echoic.v1);
generated stubs in echoic.protos.v1 (regenerate with `bash scripts/gen_protos.sh`).

DECODER_KINDS: the decoder names every door and client takes ("greedy", "beam") ->
their DecoderConfig.Kind, read off the .proto's enum so that there is one list."""

from echoic.protos.v1 import transcriber_pb2 as _pb

DECODER_KINDS: dict[str, int] = {name.lower(): k for name, k in _pb.DecoderConfig.Kind.items()}
