"""The inference loop: images decoded and preprocessed, batches formed, one fused pass, answers cut.

Owns ``images`` and ``preprocess`` (uploads decoded and checked on CPU workers), ``device_decode``
(JPEGs decoded on the device with their batch), ``fair_queue`` (each key's work taken in turn),
``engine_loop`` (one per device: forms batches, runs them, collects), ``device_runner`` (a batch's
copy and pass on the device), ``answers`` (a batch's top-k, cut per request), ``runner`` (what a
request side calls: in-process here, across the link in server/frontend/), ``tasks`` (``?tasks=``
checked against the registry) and ``warmup`` (graphs captured before traffic). May import
``errors``, ``settings``, ``telemetry``, ``store``, ``registry`` and ``tenancy``; never HTTP
(FastAPI, the edge, routers), so a model process runs it without a web framework's request types.
"""
