"""Exceptions a ZeroSum user can catch."""


class ZeroSumError(RuntimeError):
    """Base class of ZeroSum's runtime errors."""


class ZeroSumTimeout(ZeroSumError, TimeoutError):
    """An allreduce or join made no progress for the configured timeout (a peer or aggregator is gone)."""


class ProtocolViolation(ZeroSumError):
    """A peer sent something that contradicts the protocol state (not merely a lost or late packet)."""


class ZeroSumRefused(ZeroSumError):
    """An aggregator refused to admit the job (it serves as many jobs or slots as it can)."""
