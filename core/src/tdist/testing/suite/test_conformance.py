"""Every conformance body, one test each, for every --tdist-backend and world size."""

from tdist.testing import collect

collect(globals())
