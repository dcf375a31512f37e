"""The tutorial's programs ("Writing Distributed Applications with PyTorch") run with the module under test."""

from tdist.testing import collect

collect(globals(), suite="tutorial")
