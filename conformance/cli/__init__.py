"""The command line: ``hybrid-conformance`` (``python -m conformance``).

One module per subcommand (``cmd_*.py``), all thin over the one core in
:mod:`conformance.suite`."""
