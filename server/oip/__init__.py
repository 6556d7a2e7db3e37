"""The Open Inference Protocol (KServe v2 / Triton HTTP): its wire format, models and error shape.

May import ``errors``, ``registry`` and the edge (who is calling); never the app or the routers.
"""
