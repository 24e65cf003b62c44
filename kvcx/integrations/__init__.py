"""Optional integrations with other systems; each is imported only when asked for.

- :mod:`kvcx.integrations.lmcache`: kvcx as an LMCache serde (``pip install kvcx[lmcache]``).
"""
