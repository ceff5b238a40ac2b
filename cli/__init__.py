"""echoic.cli."""
