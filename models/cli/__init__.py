"""The pieces the example command lines share: flags, the checks run before loading, model and
session set-up, ``--parallel`` start-up and the streamed answer (``examples/`` holds the scripts)."""
