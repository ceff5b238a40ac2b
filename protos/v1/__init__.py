"""Generated stubs of protos/echoic/v1 (scripts/gen_protos.sh)."""
