"""The Open Inference Protocol (KServe v2 / Triton HTTP): its wire format, models and error shape."""
