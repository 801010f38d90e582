"""Kakeya's daemon: sessions, admission, step scheduling, transport, metrics and the command line.

It drives the tensor engine in `kv_cache_proposer`; the engine never imports this package.
"""

__version__ = "0.1.0"
