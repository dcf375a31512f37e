"""The tcp backend's shared memory: the segment, its step protocol and waiting policy, reductions
and the optional C part, and the one-host collectives."""
