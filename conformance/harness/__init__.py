"""The harness: memory, runners and transports that execute an implementation's plans."""
