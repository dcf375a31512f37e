"""The version of the ``tdist`` distribution: its one source (core/pyproject.toml reads it),
and the torch releases every distribution of this repository is tested with."""

__version__ = "0.1.0"

#: The torch releases tdist supports. The oldest is the first whose C++ keeps a Work written
#: in Python alive while C++ holds it (``PyWorkHolder``, 2.7): the bridge's Works are Python
#: objects, and on 2.6 and before DDP's reducer waits forever on a Work whose Python half is
#: gone. (Extension autoloading, which the bridge also needs, came in 2.5.) The newest minor
#: tested is the upper bound's predecessor. Every distribution's metadata declares this
#: range (tests/test_packaging.py checks them), and the Makefile tests both ends.
TORCH_REQUIREMENT = ">=2.7,<2.16"
