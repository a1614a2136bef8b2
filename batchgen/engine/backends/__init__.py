"""Kernel backends: the interfaces (interface.py) and the torch, cpu and triton implementations of them."""
