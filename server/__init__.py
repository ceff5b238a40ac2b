"""echoic.server: the gRPC transcription server (torch-free; the serve extra).

    config.py       ServerConfig, with units on every field
    app.py          create_server(config) -> (server, port), serve(config)
    service.py      the echoic.v1.Transcriber rpcs, admission control, status codes
    session.py      one request or stream: config, utterances, endpointing, results
    audio_input.py  request bytes -> samples at the model's rate, incrementally
    dispatcher.py   the one place work is batched: one queue and loop per model version
    models.py       the model repository, hot reload, draining
    metrics.py      Prometheus metrics (a registry per server)
    workers.py      `--workers N`: N server processes on one port, under a supervisor
    background.py   a server in a background thread, for tests and benchmarks

This package imports nothing heavy itself, so `echoic --help` stays fast; import
the module you need.
"""
