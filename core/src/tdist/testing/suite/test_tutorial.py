"""The tutorial's programs (seeds/dist_tuto.rst) run with the module under test."""
from tdist.testing import collect

collect(globals(), suite="tutorial")
