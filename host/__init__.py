"""ZeroSum: block-sparse streaming allreduce over UDP, with in-network (switch) or software aggregation."""
from .errors import ProtocolViolation, ZeroSumError, ZeroSumRefused, ZeroSumTimeout
from .worker import Worker

__all__ = ["Worker", "ZeroSumError", "ZeroSumTimeout", "ZeroSumRefused", "ProtocolViolation"]
__version__ = "0.1.0"
