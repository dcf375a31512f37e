"""The conformance suite as an installed test package:
``pytest --pyargs tdist.testing.suite --tdist-backend NAME``."""
