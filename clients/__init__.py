"""echoic.clients."""
