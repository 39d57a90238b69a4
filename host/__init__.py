"""ZeroSum: block-sparse streaming allreduce over UDP, with in-network (switch) or software aggregation."""
from . import jitcache as _jitcache
from . import perfmap as _perfmap

_perfmap.install_if_asked()    # before any kernel is compiled or loaded (perfmap: why)

_jitcache.refresh()    # before any kernel is loaded from numba's cache (jitcache: why)

from .errors import ProtocolViolation, ZeroSumError, ZeroSumRefused, ZeroSumTimeout  # noqa: E402
from .worker import Worker  # noqa: E402

__all__ = ["Worker", "ZeroSumError", "ZeroSumTimeout", "ZeroSumRefused", "ProtocolViolation"]
__version__ = "0.1.0"
