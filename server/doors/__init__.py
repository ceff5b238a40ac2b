"""The doors: each protocol's messages translated to the core's `Options` and written from its
`Result`s and `Refusal`s (echoic's gRPC service, Riva's, the HTTP door with OpenAI's audio
API and the realtime WebSocket). A door imports the core, never the process level; which
door imports which other is listed, with its reason, in tests/test_boundaries.py."""
