"""The programs of seeds/dist_tuto.rst (blocking and non-blocking p2p, all-reduce in a
group, distributed SGD, ring allreduce), verbatim apart from the import."""
from tdist.testing import collect

collect(globals(), suite="tutorial")
