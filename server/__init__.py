"""echoic.server: the transcription server (torch-free; the serve extra), in three layers.

    process/    the process level: the server built, run and stopped (app), the supervisor
                of `--workers N` server processes (workers), a server in a background
                thread for tests and benchmarks (background)
    doors/      the protocols: echoic's gRPC service (service, grpc_api), Riva's (riva), the
                HTTP door (http, with OpenAI's shapes in openai_api and the realtime
                WebSocket in realtime, and the browser page in static/)
    core/       below the doors, in no protocol's words: the types (types), options, sessions,
                audio input, the batch dispatcher, the engine process, beam decoder
                processes, the model registry, formatting, refusals
    config.py   ServerConfig, with units on every field (every layer reads it)
    metrics.py  Prometheus metrics, a registry per server (every layer counts in it)

Each layer imports only those below it: process -> doors -> core -> echoic.model.runtime
(docs/ARCHITECTURE.md, "Import rules"; tests/test_boundaries.py holds the code to it).
This package imports nothing heavy itself, so `echoic --help` stays fast; import the
module you need.
"""
