"""Scheduling: continuous batching (scheduler.py) and IO-adaptive admission, dense or offloaded (admission.py), both
pure Python and testable without a model; GPU and host pool sizing (pools.py) and the placer that sets offloaded
requests up and tears them down (placer.py)."""
