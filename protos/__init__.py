"""echoic.protos: the gRPC API. Sources in protos/echoic/v1/*.proto (package echoic.v1);
generated stubs in echoic.protos.v1 (regenerate with `bash scripts/gen_protos.sh`)."""
