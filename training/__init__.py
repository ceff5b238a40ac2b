"""echoic.training."""
