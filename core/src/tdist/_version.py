"""The version of the ``tdist`` distribution: its one source (core/pyproject.toml reads it),
and the torch releases every distribution of this repository is tested with."""

__version__ = "0.1.0"

#: The torch releases tdist supports: those the suite passes on. The newest minor tested is
#: the upper bound's predecessor. Older releases lack what the bridge needs: before 2.7
#: torch drops the Python half of a Work written in Python while its C++ holds it (DDP's
#: reducer then waits forever); on 2.7 DDP with a communication hook still hangs (not yet
#: understood), so the floor is the oldest release the whole suite passes on. Every
#: distribution's metadata declares this range (tests/test_packaging.py checks them), and
#: the Makefile tests both ends.
TORCH_REQUIREMENT = ">=2.13,<2.16"
