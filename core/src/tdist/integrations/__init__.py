"""Adapters that let other projects use tdist's backends; each imports its project only
when imported itself (``import tdist`` imports none of them).

* :mod:`tdist.integrations.torchft` -- a tdist backend as torchft's reconfigurable
  process group (``pip install torchft``).
"""
