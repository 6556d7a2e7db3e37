"""Who may do what, how much, and what they did: API keys, policies, limits, usage and the audit log.

Owns ``keys`` (the keys file: hashed keys, their roles and policies), ``policy`` (a key's limits and
allowed tasks), ``limits`` (rate, concurrency and image limits per key), ``usage`` and ``usage_log``
(per-key counts, written to the store) and ``audit`` (who changed the registry). May import the
layers below it: ``errors``, ``settings``, ``telemetry``, ``store``; never the inference loop or HTTP.
"""
