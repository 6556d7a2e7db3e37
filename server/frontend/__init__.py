"""Several processes on one port (``MEMVIT_API_PROCESSES`` > 1): a front end that uses every core.

One Python process serves HTTP, multipart parsing and CPU decoding on one event loop and a GIL it
shares with the fused pass's kernel launches. Two ways to spread that over processes
(``MEMVIT_FRONT_END``; docs/design.md §5, *Several processes*):

- ``model-process`` (the default): N API processes (``api_process.py``) run the guard, keys, limits'
  checks, multipart reading and decoding, and ship decoded images through shared memory
  (server/frontend/shm_arena.py, ``wire.py``) to one model process (``model_process.py``) that owns the
  engine, the registry, the batcher and the usage meter, over one Unix socket each
  (server/frontend/link.py). One batcher per device, so batches stay as large as one process's.
- ``replicas``: N copies of the single-process server on the one port, each its own engine and
  batcher, torch threads divided among them.

``supervisor.py`` binds the port, starts the children, restarts one that dies and stops them all on
SIGTERM; ``shared_metrics.py`` makes ``/metrics`` one view of every process.

Owns the transport between its processes too: ``link.py`` (framed calls over a Unix socket) and
``shm_arena.py`` (the shared-memory arena images travel in). May import every layer below it,
the HTTP app included (an API process serves it); only ``cli`` imports this package.
"""
