"""Adapters: named implementations and ``module:Class`` resolution."""
