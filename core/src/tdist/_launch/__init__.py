"""Helpers of :mod:`tdist.launch`: worker processes and their output."""

from .workers import Worker, WorkerGroup, WorkerSpec, free_port

__all__ = ["Worker", "WorkerGroup", "WorkerSpec", "free_port"]
