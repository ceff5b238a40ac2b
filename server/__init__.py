"""echoic.server."""
