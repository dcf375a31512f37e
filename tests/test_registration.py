"""The kit's registration check, for every first-party backend."""

from tdist.testing.suite.test_registration import test_registration

__all__ = ["test_registration"]
