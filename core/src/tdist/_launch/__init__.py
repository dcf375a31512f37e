"""Helpers of :mod:`tdist.launch`: ``workers`` (processes and their output; no torch),
``processes`` (one attempt's workers as a torchelastic process context) and ``agent``
(torch's LocalElasticAgent starting them)."""
