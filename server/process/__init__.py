"""The process level: a server built from its config, run and stopped (`app`), N of them
under a supervisor (`workers`), one in a background thread (`background`). It imports the
doors and the core; nothing below imports it."""
