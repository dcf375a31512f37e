"""The programs of the "Writing Distributed Applications with PyTorch" tutorial (blocking
and non-blocking p2p, all-reduce in a group, distributed SGD, ring allreduce), verbatim apart from the import."""

from tdist.testing import collect

collect(globals(), suite="tutorial")
