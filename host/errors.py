"""Exceptions a ZeroSum user can catch."""


class ZeroSumError(RuntimeError):
    """Base class of ZeroSum's runtime errors."""


class ZeroSumTimeout(ZeroSumError, TimeoutError):
    """An allreduce or join made no progress for the configured timeout (a peer or aggregator is gone)."""


class ProtocolViolation(ZeroSumError):
    """A peer sent something that contradicts the protocol state (not merely a lost or late packet)."""


class ZeroSumRefused(ZeroSumError):
    """An aggregator refused to admit the job (it serves as many jobs or slots as it can)."""


class AggregatorSilent(ZeroSumTimeout):
    """An aggregator answered nothing for the worker's `silence` seconds while the worker was waiting for
    it (docs/protocol.md, R-L7): it is dead, restarted or unreachable, not merely waiting for a slower
    rank (that it would say, answering probes with STATUS). `received` is a bool per block of the
    allreduce's tensor: True where the output already holds the final sum (R-L7: those blocks are final
    on this rank; everywhere else the output still holds this rank's input), or None. `collected`: for
    block-sparse results (Worker.allreduce_blocks, device tensors), the (blocks, rows) summed so far."""

    def __init__(self, message: str, received=None):
        super().__init__(message)
        self.received = received
        self.collected = None
