"""The recognition core, below the doors: a stream opened from checked `Options`, fed audio,
stepped through the batch dispatcher or the engine process, its `Result`s formatted, and
every error as a `Refusal`. It speaks no protocol (no grpc, protobuf or aiohttp) and imports
no door and nothing of the process level (tests/test_boundaries.py)."""
