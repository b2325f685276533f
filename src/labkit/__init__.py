"""labkit: the shared package of ML Systems Lab.

Importing labkit first decides the execution mode (GPU, or CPU through Triton's
interpreter) and sets ``TRITON_INTERPRET`` before triton is imported; see
:mod:`labkit.backend`. Topics live in subpackages (``labkit.memory``,
``labkit.softmax``, ...), each with its kernels, its plain-torch reference, the
functions users call, and its benchmarks kept apart.
"""

from . import backend  # noqa: I001  (must run before anything imports triton)
from .backend import MODE, describe, device, on_gpu, pick

__all__ = ["MODE", "backend", "describe", "device", "on_gpu", "pick"]
__version__ = "0.1.0"
